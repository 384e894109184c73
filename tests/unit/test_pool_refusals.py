"""Integrity refusals against transient failures (issue 19, point 3): the
worker names the blocks whose value its check refused, the scheduler side
remembers only those; a block that failed for a transient reason (an
evicted key, a dropped connection, the in-flight limit) is asked for again
by the next request.  Real redis-server."""

from __future__ import annotations

import pathlib
import sys
import types

import redis
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.redis_server import redis_server  # noqa: E402
from unit.test_pool_io import _meta, _until, _worker  # noqa: E402
from unit.test_pool_liveness import (  # noqa: E402
    BLOCK,
    _pool,
    _request,
    _scheduler,
    _serve,
    _store_chain,
)

from vllm_overlay.connectors.shared_pool.common import (  # noqa: E402
    REFUSED_KEY,
    PoolConnectorStats,
    take_stats,
)


def test_the_worker_names_refused_blocks_and_not_transient_ones(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = _pool(server.url)
        try:
            writer, cache = _worker(pool, blocks=8)
            cache.copy_(torch.randn_like(cache))
            chain = [bytes([i]) * 32 for i in range(4)]
            writer.wait_for_save(_meta(stores={"w": ([0, 1, 2, 3], chain)}))
            writer.get_finished(set())
            assert pool.drain()
            keys = [writer._key(h) for h in chain]
            client = redis.Redis(port=server.port)
            value = bytearray(client.get(keys[1]))
            value[-1] ^= 0xFF  # checksum fails: integrity
            client.set(keys[1], bytes(value))
            client.delete(keys[2])  # evicted: transient
            reader, _ = _worker(pool, blocks=8)
            reader.start_load_kv(_meta(loads={"r": ([4, 5, 6, 7], chain)}))
            _until(lambda: reader.get_finished(set())[1])
            assert reader.get_block_ids_with_load_errors() == {5, 6}
            refused = reader.take_refused()
            assert refused == [5]  # before: no distinction was made
            stats = take_stats(pool, refused)
            assert stats.data[REFUSED_KEY] == [5]
            assert reader.take_refused() == []
        finally:
            pool.close()


def _finish_load(scheduler, request, block_ids, invalid, refused, finish=True):
    """The scheduler side of one load: allocated, sent, and reported back
    by the workers with ``invalid`` block ids, ``refused`` among them (and
    the request finished, with ``finish``)."""
    from vllm.v1.outputs import KVConnectorOutput

    n, _ = scheduler.get_num_new_matched_tokens(request, 0)
    blocks = types.SimpleNamespace(get_block_ids=lambda: [block_ids])
    scheduler.update_state_after_alloc(request, blocks, n)
    scheduler.build_connector_meta(
        types.SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens={},
        )
    )
    stats = PoolConnectorStats(data={"loaded_blocks": 1, REFUSED_KEY: list(refused)})
    output = KVConnectorOutput(
        finished_recving={request.request_id},
        invalid_block_ids=set(invalid),
        kv_connector_stats=stats,
    )
    scheduler.update_connector_output(output)
    assert REFUSED_KEY not in stats.data  # not a metric: taken out
    if finish:
        scheduler.request_finished(request, block_ids)


def test_only_integrity_refusals_are_remembered(server_kind, overlay):
    with redis_server(kind=server_kind) as server:
        pool = _pool(server.url, io_threads=False)
        try:
            scheduler = _scheduler(pool)
            first = _request(1, blocks=6)
            _store_chain(server.url, first, 6)
            answers, _ = _serve(scheduler, [first], 0.5)
            assert answers["r1"][-1] == 6 * BLOCK
            # Block 2 failed for a transient reason, block 4 was refused.
            ids = [10, 11, 12, 13, 14, 15]
            _finish_load(scheduler, first, ids, invalid={12, 14}, refused={14})
            again = _request(1, blocks=6)
            again.request_id = "r1-again"
            answers, _ = _serve(scheduler, [again], 0.5)
            # Asked for again up to the refused block (before: up to the
            # first invalid block, 2, for 5 minutes).
            assert answers["r1-again"][-1] == 4 * BLOCK
        finally:
            pool.close()


def test_a_request_never_loads_again_what_its_load_failed(server_kind, overlay):
    """vLLM puts a request whose load failed back in the waiting queue and
    asks the connector again.  A transient failure (here an evicted key)
    must not be loaded again by the same request: it recomputes from its
    first failed block.  (Before, the lookup's answer was reused and the
    request loaded, failed and asked again in a loop: the chaos test saw
    2,155 loads of one request in 0.6 s.)  Another request asks again."""
    with redis_server(kind=server_kind) as server:
        pool = _pool(server.url, io_threads=False)
        try:
            scheduler = _scheduler(pool)
            first = _request(1, blocks=6)
            _store_chain(server.url, first, 6)
            answers, _ = _serve(scheduler, [first], 0.5)
            assert answers["r1"][-1] == 6 * BLOCK
            ids = [10, 11, 12, 13, 14, 15]
            _finish_load(scheduler, first, ids, invalid={13}, refused=(), finish=False)
            # vLLM computed blocks 0-2 from the load; it asks from there.
            assert scheduler.get_num_new_matched_tokens(first, 3 * BLOCK) == (0, False)
            answers, _ = _serve(scheduler, [first], 0.5)  # (from 0: stops at 3)
            assert answers["r1"][-1] == 3 * BLOCK
            scheduler.request_finished(first, ids)
            again = _request(1, blocks=6)
            again.request_id = "r1-again"
            answers, _ = _serve(scheduler, [again], 0.5)
            assert answers["r1-again"][-1] == 6 * BLOCK  # transient: asked again
        finally:
            pool.close()


def test_refusals_reach_the_scheduler_through_multi_connector_stats():
    """Under vLLM's MultiConnector a step's stats are one entry per
    connector class: the pool's refused blocks are found (and taken out)
    there too, not only in the pool connector's own stats."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorStats,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_overlay.connectors.offloading import OffloadStats
    from vllm_overlay.connectors.shared_pool.common import take_refused

    pool_stats = PoolConnectorStats(data={"load_failures": 2, REFUSED_KEY: [3, 4]})
    host_stats = OffloadStats(data={"load": {"jobs": 1, "blocks": 2}})
    multi = MultiKVConnectorStats(
        data={
            "OverlayOffloadingConnector": host_stats,
            "SharedKVPoolConnector": pool_stats,
        }
    )
    output = KVConnectorOutput(kv_connector_stats=multi)
    assert take_refused(output) == {3, 4}
    assert pool_stats.data == {"load_failures": 2}  # not a metric: taken out
    assert host_stats.data == {"load": {"jobs": 1, "blocks": 2}}
    assert take_refused(KVConnectorOutput(kv_connector_stats=multi)) == set()
    solo = PoolConnectorStats(data={REFUSED_KEY: [7]})
    assert take_refused(KVConnectorOutput(kv_connector_stats=solo)) == {7}
    assert take_refused(KVConnectorOutput()) == set()
