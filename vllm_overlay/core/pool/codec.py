"""The value stored for one KV block: a fixed header, then the payload.

Header (72 bytes, little-endian): magic ``VOKV``, format version (u16),
flags (u16; bit 0: signed, bit 1: XXH3 checksum), namespace tag (16 bytes),
key tag (8 bytes: the block's key, so a value copied under another key is
refused), layout tag (8 bytes: the writer's KV layout, as registered in its
worker), payload length (u64), checksum of the payload (u64: XXH3-64, or
CRC-32 where the writer has no ``xxhash``), MAC (16 bytes: keyed BLAKE2b
over the rest of the header and the payload; zeros when unsigned).
``check`` (header and payload where they were read, e.g. straight into a
staging buffer) and ``decode`` (one buffer) check every field; any mismatch
raises ``BadValue`` and the block is treated as a miss.  Writers send
``encode_header`` and the payload as two buffers.  Nothing is pickled.
``LandedChecks``: a load's values checked as they land (both adapters).

The checksum is XXH3-64 when the ``xxhash`` package is installed (vLLM's
optional dependency; the pool extra installs it): several times the
throughput of zlib's CRC-32.  A reader checks whichever the flags name; one
without ``xxhash`` refuses XXH3 values (not deleted: they are good for
others).

A checksum detects corruption, not forgery: anyone who can write the pool
can write a value with a valid checksum.  With a shared secret
(``mac_key``) every value is signed, and a node refuses unsigned values and
wrong MACs.  A node without a secret refuses signed values too: it cannot
check them, and a fleet with mixed secrets is a configuration error worth
noticing.

``BadValue.delete`` says whether the value should be deleted (so that the
next honest store, a SET NX, can write the block again).  Corrupt values,
values of another namespace or key, and wrong lengths: always.  Without a
secret, a signed value or one of another layout is left in the pool (another
node's value under the same key, not corruption).  With a secret, key names
derive from it (``core.pool.keys.pool_key``): only nodes holding it
write under this node's keys, so a value there that does not carry this
secret's MAC (unsigned, wrongly signed) is forged or corrupt, and is deleted
whatever else is wrong with it; one that does (another layout, or an XXH3
checksum this node cannot compute) is a good value of a node with the same
secret, and is left.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib

try:
    import xxhash
except ImportError:  # optional: CRC-32 then
    xxhash = None

MAGIC = b"VOKV"
VERSION = 3
SIGNED = 1
XXH3 = 2  # the checksum is XXH3-64 (else CRC-32)
_HEADER = struct.Struct("<4sHH16s8s8sQQ16s")
HEADER_BYTES = _HEADER.size
_MAC_AT = HEADER_BYTES - 16
_NO_MAC = bytes(16)
_NO_LAYOUT = bytes(8)


class BadValue(ValueError):
    def __init__(self, message: str, delete: bool = True, signature: bool = False):
        super().__init__(message)
        self.delete = delete  # remove it from the pool
        self.signature = signature  # unsigned, wrongly signed, or unverifiable


def key_tag(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8).digest()


def layout_tag(description: str) -> bytes:
    """8 bytes naming a KV layout (see the worker's description)."""
    return hashlib.blake2b(description.encode(), digest_size=8).digest()


def _mac(mac_key: bytes, head: bytes, payload) -> bytes:
    h = hashlib.blake2b(key=mac_key, digest_size=16, person=b"vkv-value-mac")
    h.update(head)
    h.update(payload)
    return h.digest()


def _checksum(payload, flags: int) -> int:
    if flags & XXH3:
        if xxhash is None:
            raise BadValue(
                "XXH3 checksum, and this node has no xxhash package "
                "(pip install xxhash)",
                delete=False,
            )
        return xxhash.xxh3_64_intdigest(payload)
    return zlib.crc32(payload)


def encode_header(
    namespace_tag: bytes,
    key: bytes,
    payload,
    layout: bytes = _NO_LAYOUT,
    mac_key: bytes | None = None,
) -> bytes:
    view = memoryview(payload).cast("B")
    flags = (SIGNED if mac_key else 0) | (XXH3 if xxhash is not None else 0)
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        flags,
        namespace_tag,
        key_tag(key),
        layout,
        view.nbytes,
        _checksum(view, flags),
        _NO_MAC,
    )[:_MAC_AT]
    return head + (_mac(mac_key, head, view) if mac_key else _NO_MAC)


def encode(
    namespace_tag: bytes,
    key: bytes,
    payload,
    layout: bytes = _NO_LAYOUT,
    mac_key: bytes | None = None,
) -> bytes:
    return encode_header(namespace_tag, key, payload, layout, mac_key) + bytes(payload)


def _check_header(
    namespace_tag: bytes,
    key: bytes,
    head,
    value_length: int,
    expected_length: int,
    layout: bytes,
) -> tuple[int, int, bytes]:
    """Check a value's header (its first ``HEADER_BYTES``, in place);
    returns (flags, checksum, mac)."""
    if value_length < HEADER_BYTES or len(head) < HEADER_BYTES:
        raise BadValue(f"value of {value_length} B is shorter than the header")
    magic, version, flags, ns, ktag, ltag, length, checksum, mac = _HEADER.unpack_from(
        head
    )
    if magic != MAGIC:
        raise BadValue("not a vllm-overlay KV value (bad magic)")
    if version != VERSION:
        raise BadValue(f"format version {version}, expected {VERSION}")
    if ns != namespace_tag:
        raise BadValue("value belongs to another namespace")
    if ktag != key_tag(key):
        raise BadValue("value was stored under another key")
    if ltag != layout:
        raise BadValue(
            "value has another KV layout (layout fingerprint "
            f"{ltag.hex()}, this node {layout.hex()})",
            delete=False,
        )
    if length != expected_length or value_length - HEADER_BYTES != length:
        raise BadValue(
            f"payload of {value_length - HEADER_BYTES} B, header "
            f"says {length} B, layout needs {expected_length} B"
        )
    return flags, checksum, mac


def check_header(
    namespace_tag: bytes,
    key: bytes,
    head,
    value_length: int,
    expected_length: int,
    layout: bytes = _NO_LAYOUT,
) -> None:
    """The header checks alone (no checksum): a value whose length is not
    what this node reads in place is refused for the same reasons, in the
    same order, as by ``check``."""
    _check_header(namespace_tag, key, head, value_length, expected_length, layout)


def _signed_by(mac_key: bytes, head, payload) -> bool:
    """Whether the value carries a valid MAC under ``mac_key``."""
    head = memoryview(head).cast("B")
    if head.nbytes < HEADER_BYTES or not _HEADER.unpack_from(head)[2] & SIGNED:
        return False
    return hmac.compare_digest(
        bytes(head[_MAC_AT:HEADER_BYTES]), _mac(mac_key, head[:_MAC_AT], payload)
    )


def check(
    namespace_tag: bytes,
    key: bytes,
    head,
    payload,
    expected_length: int,
    layout: bytes = _NO_LAYOUT,
    mac_key: bytes | None = None,
) -> None:
    """Check a value read in place: its header ``head`` (``HEADER_BYTES``)
    and its payload, wherever each lies; raises BadValue.  XXH3, CRC-32 and
    BLAKE2b release the GIL on large buffers."""
    payload = memoryview(payload).cast("B")
    try:
        _check(namespace_tag, key, head, payload, expected_length, layout, mac_key)
    except BadValue as exc:
        # With a secret, only a value with this secret's MAC may stay (see
        # the module docstring): anything else under our key is not honest.
        if mac_key is not None and not exc.delete:
            exc.delete = not _signed_by(mac_key, head, payload)
        raise


def _check(
    namespace_tag: bytes,
    key: bytes,
    head,
    payload: memoryview,
    expected_length: int,
    layout: bytes,
    mac_key: bytes | None,
) -> None:
    flags, checksum, mac = _check_header(
        namespace_tag,
        key,
        head,
        HEADER_BYTES + payload.nbytes,
        expected_length,
        layout,
    )
    if _checksum(payload, flags) != checksum:  # corrupt (or forged): deleted
        raise BadValue("checksum mismatch")
    signed = bool(flags & SIGNED)
    if mac_key is not None:
        if not signed:
            raise BadValue(
                "unsigned value (this node has a shared secret)",
                signature=True,
            )
        expected = _mac(mac_key, memoryview(head)[:_MAC_AT], payload)
        if not hmac.compare_digest(mac, expected):
            raise BadValue("bad signature (forged or corrupt)", signature=True)
    elif signed:
        raise BadValue(
            "signed value (this node has no shared secret)",
            delete=False,
            signature=True,
        )


def decode(
    namespace_tag: bytes,
    key: bytes,
    value: bytes,
    expected_length: int,
    layout: bytes = _NO_LAYOUT,
    mac_key: bytes | None = None,
) -> memoryview:
    """The payload of ``value`` (header and payload in one buffer), checked;
    raises BadValue."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise BadValue(f"value of {view.nbytes} B is shorter than the header")
    payload = view[HEADER_BYTES:]
    check(
        namespace_tag,
        key,
        view[:HEADER_BYTES],
        payload,
        expected_length,
        layout,
        mac_key,
    )
    return payload


def refusal(
    namespace_tag: bytes,
    key: bytes,
    value,
    place,
    expected_length: int,
    layout: bytes = _NO_LAYOUT,
    mac_key: bytes | None = None,
) -> BadValue | None:
    """Why a loaded value may not be used (None: it may).  ``value`` is what
    ``KVPool.submit_load`` handed back: None (missing), an ``Oversized``
    (longer than ours, never read), bytes (not our length: read whole) or an
    ``InPlace`` (read into the header and payload buffers ``place()``
    returns, checked there)."""
    from vllm_overlay.core.pool.resp import Oversized

    try:
        if value is None:
            raise BadValue("missing")
        if isinstance(value, Oversized):
            raise BadValue(
                f"value of {len(value)} B, this node's values are "
                f"{expected_length + HEADER_BYTES} B"
            )
        if isinstance(value, (bytes, bytearray)):
            decode(namespace_tag, key, value, expected_length, layout, mac_key)
            raise BadValue(f"value of {len(value)} B")  # (decode raised)
        head, payload = place()
        check(namespace_tag, key, head, payload, expected_length, layout, mac_key)
    except BadValue as exc:
        return exc
    return None


class LandedChecks:
    """One load's values checked as they land, shared by both adapters (the
    0.11.2 connector's worker, the 0.32 pool tier).  ``KVPool.submit_load``
    calls ``landed(i, value)`` on the load thread as soon as value ``i`` is
    read (so it is checked in place while the server sends the next ones),
    and ``verdicts(values)`` once that thread is done writing (its
    ``prepare``): a value not checked as it landed (missing, or the load
    cut off) is checked then.  ``refusal(i, value)``: the adapter's
    ``refusal`` of value ``i`` where it lies (None: good)."""

    __slots__ = ("_refusal", "_checked")

    def __init__(self, n: int, refusal) -> None:
        self._refusal = refusal
        self._checked: list = [None] * n  # (refusal,) once checked

    def landed(self, i: int, value) -> None:
        self._checked[i] = (self._refusal(i, value),)

    def verdicts(self, values: list) -> list[tuple[BadValue | None, bool]]:
        """Per value: its refusal (None: good), and whether a value came
        (a refused one that came failed its check: integrity)."""
        out = []
        for i, value in enumerate(values):
            done = self._checked[i]
            if done is None or value is None:
                done = (self._refusal(i, value),)
            out.append((done[0], value is not None))
        return out
