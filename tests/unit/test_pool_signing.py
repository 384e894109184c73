"""Shared secret and layout fingerprint, and long prompts, against a real
redis-server: signed values round-trip, anything else is refused (and left
in the pool); stores are admitted block by block in prefix order; loads are
bounded and what is not loaded is reported for recompute."""

from __future__ import annotations

import logging
import pathlib
import sys
import types

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

# Imported first: importing vLLM configures its loggers, and a handler a
# test adds to the overlay's logger must come after that.
import vllm_overlay.connectors.shared_pool.worker as worker_module  # noqa: E402
from vllm_overlay.core.ops.block_copy import BlockTable  # noqa: E402
from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

NS = b"n" * 16
LAYOUT = codec.layout_tag("cross-layer|test")
SECRET = "correct horse battery staple 42"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

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
    assert SECRET not in repr(from_file) and SECRET not in repr(from_env)
    assert PoolConfig(url="redis://h").mac_key is None
    monkeypatch.setenv("VKV_TEST_SECRET", "short")
    with pytest.raises(ValueError, match="secret_env.*at least 16 bytes"):
        PoolConfig(url="redis://h", secret_env="VKV_TEST_SECRET")


def _store_and_fetch(writer: PoolConfig, value_of) -> bytes:
    with redis_server() as server:
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
    secret_file, monkeypatch
):
    payload = bytes(range(256)) * 4
    signer = PoolConfig(url="redis://h", secret_file=secret_file)
    monkeypatch.setenv("VKV_OTHER", "another secret, also long enough")
    other = PoolConfig(url="redis://h", secret_env="VKV_OTHER")
    signed = _store_and_fetch(
        signer, lambda c: codec.encode(NS, b"k", payload, LAYOUT, c.mac_key)
    )
    unsigned = codec.encode(NS, b"k", payload, LAYOUT)
    # Same secret: loads.
    assert bytes(codec.decode(NS, b"k", signed, len(payload), LAYOUT, signer.mac_key))
    # Wrong secret, unsigned value on a signing node, signed value on a
    # node without a secret: refused, flagged, and not to be deleted.
    cases = [
        (signed, other.mac_key, "bad signature"),
        (unsigned, signer.mac_key, "unsigned value"),
        (signed, None, "signed value"),
    ]
    for value, key, message in cases:
        with pytest.raises(codec.BadValue, match=message) as info:
            codec.decode(NS, b"k", value, len(payload), LAYOUT, key)
        assert info.value.signature and not info.value.delete
    # A forger who rewrites the payload and fixes the CRC is caught by the MAC.
    forged = bytearray(signed)
    forged[codec.HEADER_BYTES] ^= 0xFF
    head = codec.encode_header(NS, b"k", forged[codec.HEADER_BYTES :], LAYOUT)
    forged[: codec.HEADER_BYTES - 16] = head[: codec.HEADER_BYTES - 16]
    forged[6] |= codec.SIGNED  # claims to be signed, keeps the old MAC
    with pytest.raises(codec.BadValue, match="bad signature"):
        codec.decode(NS, b"k", bytes(forged), len(payload), LAYOUT, signer.mac_key)


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


def test_worker_refuses_bad_signatures_without_deleting(secret_file, caplog):
    payload = b"p" * 32
    with redis_server() as server:
        signing = KVPool(PoolConfig(url=server.url, secret_file=secret_file))
        try:
            worker = _worker(signing, len(payload))
            chain = [b"\x01" * 8, b"\x02" * 8]
            keys = [worker._key(h) for h in chain]
            server_pool = KVPool(PoolConfig(url=server.url))
            try:  # an unsigned and a corrupt value
                server_pool.submit_store(
                    [
                        (keys[0], codec.encode(NS, keys[0], payload, LAYOUT)),
                        (keys[1], b"VOKV" + b"\0" * 100),
                    ]
                )
                assert server_pool.drain()
            finally:
                server_pool.close()
            with caplog.at_level(logging.WARNING, logger="vllm.overlay"):
                errors = _load_with_worker(worker, signing, chain, [5, 6])
            assert errors == {5, 6}
            assert signing.drain()
            stats = signing.cumulative()
            assert stats["bad_signatures"] == 1 and stats["load_failures"] == 2
            # The unsigned value stays (another node may verify it); the
            # corrupt one is deleted.
            assert server.cli("exists", keys[0].decode()) == "1"
            assert server.cli("exists", keys[1].decode()) == "0"
            refusals = [r for r in caplog.records if "refused" in r.getMessage()]
            assert len(refusals) == 1  # rate-limited
        finally:
            signing.close()


def test_long_store_batch_is_admitted_block_by_block_in_prefix_order(caplog):
    with redis_server() as server:
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


def test_a_block_after_one_that_does_not_fit_is_not_stored():
    with redis_server() as server:
        pool = KVPool(PoolConfig(url=server.url, max_inflight_bytes=1000))
        try:
            items = [(b"a", b"1" * 100), (b"b", b"2" * 950), (b"c", b"3" * 10)]
            assert pool.submit_store(items) == 1 and pool.drain()
            assert server.cli("exists", "c") == "0"  # fits, but useless alone
        finally:
            pool.close()


def test_loads_are_bounded_and_the_rest_is_reported_for_recompute():
    payload = b"q" * 200
    value_bytes = len(payload) + codec.HEADER_BYTES
    with redis_server() as server:
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
