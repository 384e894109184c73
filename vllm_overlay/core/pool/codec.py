"""The value stored for one KV block: a fixed header, then the payload.

Header (48 bytes, little-endian): magic ``VOKV``, format version (u16),
reserved (u16), namespace tag (16 bytes), key tag (8 bytes: the block's key,
so a value copied under another key is refused), payload length (u64), CRC-32
of the payload (u32), reserved (u32).  ``decode`` checks every field; any
mismatch raises ``BadValue`` and the block is treated as a miss.  Nothing is
pickled.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

MAGIC = b"VOKV"
VERSION = 1
_HEADER = struct.Struct("<4sHH16s8sQII")
HEADER_BYTES = _HEADER.size


class BadValue(ValueError):
    pass


def key_tag(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8).digest()


def encode_header(namespace_tag: bytes, key: bytes, payload) -> bytes:
    view = memoryview(payload).cast("B")
    return _HEADER.pack(
        MAGIC, VERSION, 0, namespace_tag, key_tag(key), view.nbytes, zlib.crc32(view), 0
    )


def encode(namespace_tag: bytes, key: bytes, payload) -> bytes:
    return encode_header(namespace_tag, key, payload) + bytes(payload)


def decode(
    namespace_tag: bytes, key: bytes, value: bytes, expected_length: int
) -> memoryview:
    """The payload of ``value``, checked; raises BadValue."""
    if len(value) < HEADER_BYTES:
        raise BadValue(f"value of {len(value)} B is shorter than the header")
    magic, version, _, ns, ktag, length, crc, _ = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BadValue("not a vllm-overlay KV value (bad magic)")
    if version != VERSION:
        raise BadValue(f"format version {version}, expected {VERSION}")
    if ns != namespace_tag:
        raise BadValue("value belongs to another namespace")
    if ktag != key_tag(key):
        raise BadValue("value was stored under another key")
    if length != expected_length or len(value) - HEADER_BYTES != length:
        raise BadValue(
            f"payload of {len(value) - HEADER_BYTES} B, header "
            f"says {length} B, layout needs {expected_length} B"
        )
    payload = memoryview(value)[HEADER_BYTES:]
    if zlib.crc32(payload) != crc:
        raise BadValue("checksum mismatch")
    return payload
