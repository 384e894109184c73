"""Pool key names and namespaces, the same for every vLLM release: what two
nodes must agree on to share a block (no vLLM import here; each release's
adapter lists the factors that shape its KV bytes)."""

from __future__ import annotations

import functools
import hashlib


def namespace_tag(factors: list[str]) -> bytes:
    """16 bytes naming everything that decides a block's bytes."""
    return hashlib.blake2b("|".join(factors).encode(), digest_size=16).digest()


def pool_key(
    ns: bytes, chain_hash: bytes, rank: int, name_key: bytes | None = None
) -> bytes:
    """``vkv:<namespace>:r<rank>:<block>``.  Without a secret the parts are
    the namespace tag and the chain hash themselves, so anyone who knows the
    model config can compute the key of a prompt.  With one (``name_key``,
    ``PoolConfig.name_key``) both are keyed BLAKE2b hashes (the block part of
    the namespace, rank and chain hash): without the secret the key names
    reveal nothing and cannot be computed from a prompt, and a node with
    another secret uses other keys."""
    if name_key is None:
        return b"vkv:%s:r%d:%s" % (ns.hex().encode(), rank, chain_hash.hex().encode())
    ns_part, block_state = _keyed_names(name_key, ns, rank)
    h = block_state.copy()
    h.update(chain_hash)
    return b"vkv:%s:r%d:%s" % (ns_part, rank, h.hexdigest().encode())


@functools.lru_cache(maxsize=64)
def _keyed_names(name_key: bytes, ns: bytes, rank: int):
    """(the namespace part, the keyed hash state of the block part up to the
    chain hash) for one namespace and rank: a key then costs one copy and
    one 32-byte update (no re-keying)."""
    ns_part = hashlib.blake2b(
        ns, key=name_key, digest_size=16, person=b"vkv-key-ns"
    ).hexdigest()
    state = hashlib.blake2b(key=name_key, digest_size=32, person=b"vkv-key-block")
    state.update(ns)
    state.update(b"r%d:" % rank)
    return ns_part.encode(), state
