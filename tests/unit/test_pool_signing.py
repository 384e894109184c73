"""Shared secret and layout fingerprint, and long prompts, against a real
redis-server: signed values round-trip, anything else is refused; with a
secret, key names derive from it and a value under them without its MAC is
deleted, so the next honest store writes the block again; stores are
admitted block by block in prefix order; loads are bounded and what is not
loaded is reported for recompute."""

from __future__ import annotations

import hashlib
import logging
import pathlib
import sys
import types

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.log_records import LogRecords  # noqa: E402
from support.redis_server import redis_server  # noqa: E402

# Imported first: importing vLLM configures its loggers, and a handler a
# test adds to the overlay's logger must come after that.
import vllm_overlay.connectors.shared_pool.worker as worker_module  # noqa: E402
from vllm_overlay.core.ops.block_copy import BlockTable  # noqa: E402
from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.keys import pool_key  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

NS = b"n" * 16
LAYOUT = codec.layout_tag("cross-layer|test")
SECRET = "correct horse battery staple 42"


class _Records(LogRecords):
    def at_level(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


@pytest.fixture
def caplog():
    """Records of the overlay's logger (vLLM's loggers do not propagate)."""
    records = _Records()
    logger = logging.getLogger("vllm.overlay")
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "pool.secret"
    path.write_text(SECRET + "\n")
    return str(path)


def test_secret_comes_from_a_file_or_the_environment(secret_file, monkeypatch):
    monkeypatch.setenv("VKV_TEST_SECRET", SECRET)
    from_file = PoolConfig(url="redis://h", secret_file=secret_file)
    from_env = PoolConfig(url="redis://h", secret_env="VKV_TEST_SECRET")
    assert from_file.mac_key == from_env.mac_key and len(from_file.mac_key) == 64
    # The key-name key: derived from the same secret, independent of the
    # MAC key (neither reveals the other, nor the secret).
    assert from_file.name_key == from_env.name_key and len(from_file.name_key) == 32
    assert from_file.name_key not in from_file.mac_key
    for derived in (from_file.mac_key, from_file.name_key):
        assert SECRET.encode() not in derived
    assert SECRET not in repr(from_file) and SECRET not in repr(from_env)
    assert PoolConfig(url="redis://h").mac_key is None
    assert PoolConfig(url="redis://h").name_key is None
    monkeypatch.setenv("VKV_TEST_SECRET", "short")
    with pytest.raises(ValueError, match="secret_env.*at least 16 bytes"):
        PoolConfig(url="redis://h", secret_env="VKV_TEST_SECRET")


def _store_and_fetch(kind: str, writer: PoolConfig, value_of) -> bytes:
    with redis_server(kind=kind) as server:
        pool = KVPool(PoolConfig(url=server.url))
        try:
            assert pool.submit_store([(b"k", value_of(writer))]) == 1
            assert pool.drain()
            pool.submit_load("j", [b"k"])
            assert pool.drain()
            ((_, (value,)),) = pool.poll_loads()
        finally:
            pool.close()
    return value


def test_signed_values_round_trip_and_everything_else_is_refused(
    server_kind, secret_file, monkeypatch
):
    payload = bytes(range(256)) * 4
    signer = PoolConfig(url="redis://h", secret_file=secret_file)
    monkeypatch.setenv("VKV_OTHER", "another secret, also long enough")
    other = PoolConfig(url="redis://h", secret_env="VKV_OTHER")
    signed = _store_and_fetch(
        server_kind,
        signer,
        lambda c: codec.encode(NS, b"k", payload, LAYOUT, c.mac_key),
    )
    unsigned = codec.encode(NS, b"k", payload, LAYOUT)
    # Same secret: loads.
    assert bytes(codec.decode(NS, b"k", signed, len(payload), LAYOUT, signer.mac_key))
    # Under a signing node's keys (derived from its secret) only nodes with
    # that secret write: a value with another secret's MAC, or none, is
    # refused, flagged and deleted.  A node without a secret cannot verify
    # a signed value: refused, flagged, left in the pool.
    cases = [
        (signed, other.mac_key, "bad signature", True),
        (unsigned, signer.mac_key, "unsigned value", True),
        (signed, None, "signed value", False),
    ]
    for value, key, message, delete in cases:
        with pytest.raises(codec.BadValue, match=message) as info:
            codec.decode(NS, b"k", value, len(payload), LAYOUT, key)
        assert info.value.signature and info.value.delete is delete
    # A forger who rewrites the payload and fixes the checksum is caught by
    # the MAC, and the forgery is deleted.
    forged = _forged(signed)
    with pytest.raises(codec.BadValue, match="bad signature") as info:
        codec.decode(NS, b"k", forged, len(payload), LAYOUT, signer.mac_key)
    assert info.value.delete


def _forged(signed: bytes, key: bytes = b"k", layout: bytes = LAYOUT) -> bytes:
    """``signed`` with a payload byte changed, the checksum fixed, and the
    old MAC kept: what a writer without the secret can produce."""
    forged = bytearray(signed)
    forged[codec.HEADER_BYTES] ^= 0xFF
    head = codec.encode_header(NS, key, forged[codec.HEADER_BYTES :], layout)
    forged[: codec.HEADER_BYTES - 16] = head[: codec.HEADER_BYTES - 16]
    forged[6] |= codec.SIGNED  # claims to be signed, keeps the old MAC
    return bytes(forged)


def test_with_a_secret_only_a_value_with_its_mac_is_left_in_the_pool(secret_file):
    """Another layout is refused either way; it stays only when this
    secret signed it (a node with the same secret and another layout), so a
    writer without the secret cannot block a key with a value that claims
    another layout."""
    mac_key = PoolConfig(url="redis://h", secret_file=secret_file).mac_key
    payload = b"x" * 64
    other_layout = codec.layout_tag("per-layer|HND")
    honest = codec.encode(NS, b"k", payload, other_layout, mac_key)
    cases = [
        (honest, False),
        (codec.encode(NS, b"k", payload, other_layout), True),  # unsigned
        (_forged(honest, layout=other_layout), True),  # wrong MAC
    ]
    for value, delete in cases:
        with pytest.raises(codec.BadValue, match="another KV layout") as info:
            codec.decode(NS, b"k", value, len(payload), LAYOUT, mac_key)
        assert info.value.delete is delete


def test_unsigned_key_names_are_unchanged():
    """Without a secret, keys stay what every earlier release wrote."""
    assert pool_key(b"\x01" * 16, b"\xab" * 32, 3) == (
        b"vkv:" + b"01" * 16 + b":r3:" + b"ab" * 32
    )


def test_with_a_secret_key_names_reveal_nothing(secret_file, monkeypatch):
    """A reader without the secret cannot compute a prompt's key: no part
    of it is the namespace or the chain hash, and it changes with the
    secret; it still depends on namespace, rank and chain hash."""
    name_key = PoolConfig(url="redis://h", secret_file=secret_file).name_key
    monkeypatch.setenv("VKV_OTHER", "another secret, also long enough")
    other = PoolConfig(url="redis://h", secret_env="VKV_OTHER").name_key
    chain = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    plain = {pool_key(NS, h, r) for h in chain for r in (0, 1)}
    keyed = {pool_key(NS, h, r, name_key) for h in chain for r in (0, 1)}
    assert len(keyed) == 8 and not keyed & plain
    assert not keyed & {pool_key(NS, h, r, other) for h in chain for r in (0, 1)}
    assert pool_key(NS, chain[0], 0, name_key) == pool_key(NS, chain[0], 0, name_key)
    assert pool_key(b"m" * 16, chain[0], 0, name_key) not in keyed
    secrets = [NS.hex()] + [h.hex() for h in chain]
    for key in keyed:
        prefix, ns_part, rank, block = key.decode().split(":")
        assert prefix == "vkv" and rank in ("r0", "r1")
        assert len(ns_part) == 32 and len(block) == 64
        for text in secrets:  # no 8 hex digits of namespace or chain hash
            pieces = {text[i : i + 8] for i in range(len(text) - 7)}
            assert not any(piece in key.decode() for piece in pieces)


def test_another_layout_is_refused_and_left_in_the_pool():
    payload = b"x" * 64
    value = codec.encode(NS, b"k", payload, codec.layout_tag("per-layer|HND"))
    with pytest.raises(codec.BadValue, match="another KV layout") as info:
        codec.decode(NS, b"k", value, len(payload), LAYOUT)
    assert not info.value.delete and not info.value.signature


def _worker(pool: KVPool, block_bytes: int):
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1))
    worker = worker_module.SharedPoolWorker(config, NS, pool)
    cache = torch.zeros(16, block_bytes, dtype=torch.uint8)
    worker._set_table(BlockTable.from_tensors([cache], 0), "test", LAYOUT)
    return worker


def _load_with_worker(worker, pool, chain, block_ids):
    meta = types.SimpleNamespace(loads={"req": (block_ids, chain)}, stores={})
    worker.start_load_kv(meta)
    assert pool.drain()
    worker._finish_loads()
    return worker.get_block_ids_with_load_errors()


def _write(server, items) -> None:
    """Write ``(key, value)`` pairs as a writer without the secret would."""
    pool = KVPool(PoolConfig(url=server.url))
    try:
        pool.submit_store(items)
        assert pool.drain()
    finally:
        pool.close()


def test_signing_worker_deletes_values_its_secret_did_not_sign(
    server_kind, secret_file, caplog
):
    payload = b"p" * 32
    with redis_server(kind=server_kind) as server:
        signing = KVPool(PoolConfig(url=server.url, secret_file=secret_file))
        try:
            worker = _worker(signing, len(payload))
            chain = [b"\x01" * 8, b"\x02" * 8, b"\x03" * 8]
            keys = [worker._key(h) for h in chain]
            good = codec.encode(NS, keys[2], payload, LAYOUT, signing.config.mac_key)
            # An unsigned value (with a valid checksum), a corrupt one, and
            # a forged one (wrong MAC), under the signing node's own keys.
            _write(
                server,
                [
                    (keys[0], codec.encode(NS, keys[0], b"u" * 32, LAYOUT)),
                    (keys[1], b"VOKV" + b"\0" * 100),
                    (keys[2], _forged(good, keys[2])),
                ],
            )
            with caplog.at_level(logging.WARNING, logger="vllm.overlay"):
                errors = _load_with_worker(worker, signing, chain, [5, 6, 7])
            assert errors == {5, 6, 7}
            assert signing.drain()
            stats = signing.cumulative()
            assert stats["bad_signatures"] == 2 and stats["load_failures"] == 3
            assert stats["loaded_blocks"] == 0
            assert [server.cli("exists", k.decode()) for k in keys] == ["0"] * 3
            refusals = [r for r in caplog.records if "refused" in r.getMessage()]
            assert len(refusals) == 1  # rate-limited
            assert "deleted" in refusals[0].getMessage()
        finally:
            signing.close()


def test_an_honest_store_replaces_a_refused_value(server_kind, secret_file):
    """A forged value under a signing node's key is refused and deleted;
    the block, recomputed, is stored by the same worker (its delete and its
    store are ordered: the store's EXISTS does not see the forgery), and
    another node with the secret then loads the honest value."""
    import redis

    payload = bytes(range(32))
    chain = [b"\x01" * 8]
    with redis_server(kind=server_kind) as server:
        config = PoolConfig(url=server.url, secret_file=secret_file)
        signing, reader = KVPool(config), KVPool(config)
        try:
            worker = _worker(signing, len(payload))
            key = worker._key(chain[0])
            honest = codec.encode(NS, key, payload, LAYOUT, config.mac_key)
            _write(server, [(key, _forged(honest, key))])
            assert _load_with_worker(worker, signing, chain, [5]) == {5}
            # vLLM recomputes block 5; the scheduler asks to store it.
            cache = worker._cache_words.view(torch.uint8)
            cache[5] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            worker.wait_for_save(
                types.SimpleNamespace(loads={}, stores={"req": ([5], chain)})
            )
            worker.get_finished({"req"})
            assert signing.drain()
            assert signing.cumulative()["stored_blocks"] == 1
            assert redis.Redis.from_url(server.url).get(key) == honest
            # A third node loads it.
            other = _worker(reader, len(payload))
            assert _load_with_worker(other, reader, chain, [9]) == set()
            assert bytes(other._cache_words.view(torch.uint8)[9].numpy()) == payload
            assert reader.cumulative()["loaded_blocks"] == 1
        finally:
            signing.close()
            reader.close()


def test_refused_bytes_read_into_a_kv_block_are_wiped(server_kind, secret_file):
    """On CPU a value is read straight into its KV block and checked after.
    A refused one (here all NaN, under a checksum that does not match, and
    unsigned NaN under a valid checksum) must not stay there: vLLM may free
    the block before recomputing it, and the unfilled slots of a partial
    block given to another request would feed NaN through the attention
    (masked, x 0 = NaN).  Refused blocks are zeroed; the good one holds its
    payload, a block no load touched keeps its bytes."""
    block = 64
    nan = torch.full((block // 4,), float("nan")).view(torch.uint8).numpy().tobytes()
    good_payload = bytes(range(block))
    with redis_server(kind=server_kind) as server:
        signing = KVPool(PoolConfig(url=server.url, secret_file=secret_file))
        try:
            worker = _worker(signing, block)
            cache = worker._cache_words.view(torch.uint8)
            assert worker._cache_rows is not None  # the direct path
            cache.fill_(7)
            chain = [b"\x01" * 8, b"\x02" * 8, b"\x03" * 8]
            keys = [worker._key(h) for h in chain]
            mac = signing.config.mac_key
            bad_sum = bytearray(codec.encode(NS, keys[0], good_payload, LAYOUT, mac))
            bad_sum[codec.HEADER_BYTES :] = nan
            _write(
                server,
                [
                    (keys[0], bytes(bad_sum)),
                    (keys[1], codec.encode(NS, keys[1], nan, LAYOUT)),
                    (keys[2], codec.encode(NS, keys[2], good_payload, LAYOUT, mac)),
                ],
            )
            assert _load_with_worker(worker, signing, chain, [5, 6, 9]) == {5, 6}
            assert signing.cumulative()["loaded_blocks"] == 1
            assert not cache[5].any() and not cache[6].any()
            assert bytes(cache[9].numpy()) == good_payload
            assert (cache[4] == 7).all()  # untouched
        finally:
            signing.close()


def test_long_store_batch_is_admitted_block_by_block_in_prefix_order(
    server_kind, caplog
):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, max_inflight_bytes=1000))
        try:
            items = [(b"b%d" % i, b"v" * 300) for i in range(5)]
            with caplog.at_level(logging.WARNING, logger="vllm.overlay"):
                assert pool.submit_store(items) == 3
                assert pool.drain()
                assert pool.submit_store(items[3:]) == 2  # the rest, later
                assert pool.submit_store([(b"huge", b"h" * 1001)]) == 0
                assert pool.drain()
            assert pool.count_hits([k for k, _ in items]) == 5
            stats = pool.cumulative()
            assert stats["stored_blocks"] == 5 and stats["dropped_stores"] == 3
            drops = [
                r.getMessage() for r in caplog.records if "dropped" in r.getMessage()
            ]
            assert len(drops) == 1  # rate-limited
            assert "5 block(s): 3 admitted, 2 dropped" in drops[0]
        finally:
            pool.close()


def test_a_block_after_one_that_does_not_fit_is_not_stored(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, max_inflight_bytes=1000))
        try:
            items = [(b"a", b"1" * 100), (b"b", b"2" * 950), (b"c", b"3" * 10)]
            assert pool.submit_store(items) == 1 and pool.drain()
            assert server.cli("exists", "c") == "0"  # fits, but useless alone
        finally:
            pool.close()


def test_loads_are_bounded_and_the_rest_is_reported_for_recompute(server_kind):
    payload = b"q" * 200
    value_bytes = len(payload) + codec.HEADER_BYTES
    with redis_server(kind=server_kind) as server:
        pool = KVPool(
            PoolConfig(
                url=server.url,
                max_inflight_bytes=10**6,
                max_inflight_load_bytes=3 * value_bytes,
            )
        )
        try:
            worker = _worker(pool, len(payload))
            chain = [bytes([i]) * 8 for i in range(5)]
            keys = [worker._key(h) for h in chain]
            pool.submit_store([(k, codec.encode(NS, k, payload, LAYOUT)) for k in keys])
            assert pool.drain()
            assert pool.submit_load("j", keys, value_bytes) == 3
            assert pool.drain()
            ((_, values),) = pool.poll_loads()
            assert values[:3] == [
                codec.encode(NS, k, payload, LAYOUT) for k in keys[:3]
            ]
            assert values[3:] == [None, None]
            assert pool.cumulative()["limited_loads"] == 2
            # Through the worker: blocks beyond the limit are load errors,
            # so vLLM recomputes them; the first three are scattered.
            errors = _load_with_worker(worker, pool, chain, [10, 11, 12, 13, 14])
            assert errors == {13, 14}
            cache = worker._cache_words.view(torch.uint8)
            assert [bytes(cache[b].numpy()) == payload for b in range(10, 15)] == [
                True,
                True,
                True,
                False,
                False,
            ]
            assert server.cli("exists", keys[4].decode()) == "1"  # not deleted
        finally:
            pool.close()
