"""Liveness: vLLM's scheduler never waits on the pool, whatever the pool
does (hung, slow, unreachable, full, read-only, denied, one cluster node
hung), and every failure kind gets its own reaction.  Real redis-server
instances; a hung server is a loopback socket that accepts and never
answers, or a redis-server stopped with SIGSTOP."""

from __future__ import annotations

import pathlib
import sys
import threading
import time
import types

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import (  # noqa: E402
    SlowServer,
    hung_server,
    redis_cluster,
    redis_server,
)

from vllm_overlay.core.pool import pool as pool_module  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.errors import Failure, classify  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402
from vllm_overlay.testing.redis import DEFAULT_KIND, KINDS  # noqa: E402

BLOCK = 4
NS = b"n" * 16
# Short timeouts so a test sees several back-off rounds in a few seconds.
FAST = dict(
    connect_timeout_s=0.5,
    timeout_s=1.0,
    lookup_wait_s=0.1,
    retry_backoff_s=0.3,
    max_retry_backoff_s=0.6,
)
# The scheduler thread must never wait on the network: a call that took a
# network timeout (0.5-1 s here, 2 s by default) would exceed this bound.
CALL_BOUND_S = 0.25


def _pool(url: str, io_threads: bool = True, **extra) -> KVPool:
    """A pool; with ``io_threads=False`` the scheduler's kind, its lookup
    thread connected (or failed to) before it is returned."""
    pool = KVPool(
        PoolConfig(url=url, **{**FAST, **extra}),
        io_threads=io_threads,
        lookups=not io_threads,
    )
    deadline = time.monotonic() + 10
    while not io_threads and not pool._lookups_ready:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pool


def _scheduler(pool):
    from vllm_overlay.connectors.shared_pool.scheduler import SharedPoolScheduler

    config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(
            block_size=BLOCK, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=types.SimpleNamespace(world_size=1),
    )
    scheduler = SharedPoolScheduler(config, NS, pool)
    scheduler._chain(_request(-1))  # import vLLM's hashing before timing calls
    return scheduler


def _request(i: int, blocks: int = 6):
    tokens = [1000 * i + t for t in range(blocks * BLOCK + 1)]
    return types.SimpleNamespace(
        request_id=f"r{i}",
        all_token_ids=tokens,
        num_tokens=len(tokens),
        mm_features=[],
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
    )


def _serve(scheduler, requests, seconds: float):
    """Ask for every request every 5 ms, as vLLM's scheduler would while
    they wait, for ``seconds``; return (answers per request, slowest call)."""
    answers: dict[str, list] = {r.request_id: [] for r in requests}
    slowest = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for request in requests:
            if answers[request.request_id][-1:] in ([None], []):
                start = time.perf_counter()
                n, _ = scheduler.get_num_new_matched_tokens(request, 0)
                slowest = max(slowest, time.perf_counter() - start)
                answers[request.request_id].append(n)
        time.sleep(0.005)
    return answers, slowest


def _store_chain(url: str, request, blocks: int, cluster: bool = False):
    """Put the first ``blocks`` keys of ``request``'s chain in the pool."""
    from vllm_overlay.core.pool.keys import pool_key

    scheduler = _scheduler(None)
    chain = scheduler._chain(request)
    pool = _pool(url, cluster=cluster)
    try:
        keys = [pool_key(NS, h, 0) for h in chain[:blocks]]
        assert pool.submit_store([(k, b"v") for k in keys]) == blocks
        assert pool.drain()
        assert pool.cumulative()["stored_blocks"] == blocks
    finally:
        pool.close()


def test_every_failure_named_in_the_issue_has_its_kind():
    import redis.exceptions as rex

    cases = {
        rex.ConnectionError("refused"): Failure.UNREACHABLE,
        rex.TimeoutError("timed out"): Failure.UNREACHABLE,
        rex.BusyLoadingError("LOADING"): Failure.UNREACHABLE,
        rex.RedisClusterException("no startup node"): Failure.UNREACHABLE,
        rex.ClusterDownError("CLUSTERDOWN The cluster is down"): Failure.UNREACHABLE,
        rex.MasterDownError("MASTERDOWN"): Failure.UNREACHABLE,
        rex.SlotNotCoveredError("slot"): Failure.UNREACHABLE,
        rex.TryAgainError("TRYAGAIN"): Failure.UNREACHABLE,
        OSError("network is unreachable"): Failure.UNREACHABLE,
        rex.OutOfMemoryError("OOM command not allowed"): Failure.FULL,
        rex.ReadOnlyError("READONLY replica"): Failure.READ_ONLY,
        rex.NoPermissionError("NOPERM no set"): Failure.DENIED,
        rex.AuthenticationError("invalid password"): Failure.DENIED,
        rex.ResponseError("WRONGTYPE Operation against a key"): Failure.BAD_KEY,
        rex.ResponseError("ERR invalid expire time in 'set'"): Failure.BAD_REQUEST,
        rex.ResponseError("ERR unknown command 'SET'"): Failure.BAD_REQUEST,
        RuntimeError("a bug"): Failure.INTERNAL,  # not the server: no pause
    }
    assert {str(e): classify(e) for e in cases} == {
        str(e): kind for e, kind in cases.items()
    }


# A hung server is a plain socket that never answers: no server kind, one
# case (the others run against every kind).
NEVER_WAITS_CASES = [(DEFAULT_KIND, "hung")] + [
    (kind, failure) for kind in KINDS for failure in ("slow", "unreachable")
]


@pytest.mark.parametrize(
    "server_kind, failure",
    NEVER_WAITS_CASES,
    ids=["hung"] + [f"{k}-{f}" for k, f in NEVER_WAITS_CASES[1:]],
)
def test_the_scheduler_never_waits_and_requests_recompute(server_kind, failure):
    """Hung or unreachable from the start: the lookup thread's first
    connection fails (in the background), the pool pauses, every request
    is answered 0 at once.  Slow once connected: the first request waits
    at most lookup_wait_s (answered None: ask again), then computes without
    the pool; the pool pauses itself, and every later request is answered
    0 at once, without the network."""
    requests = [_request(i) for i in range(4)]
    if failure == "hung":
        ctx = hung_server()
    else:
        ctx = redis_server("--enable-debug-command", "yes", kind=server_kind)
    with ctx as server:
        url = server.url
        slow = None
        if failure == "slow":
            _store_chain(url, requests[0], 6)
        elif failure == "unreachable":
            server.stop()
        # A long pause: no health PING during the test (a PING can slip in
        # between two DEBUG SLEEPs and reopen the pool for a moment).
        pool = _pool(
            url,
            io_threads=False,
            timeout_s=2.0,
            retry_backoff_s=5.0,
            max_retry_backoff_s=10.0,
        )
        try:
            if failure == "slow":  # answers, but only after 1.4 s (< timeout_s)
                slow = SlowServer(server, 1.4)
                time.sleep(0.2)
            scheduler = _scheduler(pool)
            answers, slowest = _serve(scheduler, requests[:1], 0.5)
            assert slowest < CALL_BOUND_S
            (first,) = answers.values()
            assert first[-1] == 0  # computed without the pool
            if failure == "slow":
                assert first[0] is None  # it was asked again while waiting
                assert pool.cumulative()["lookup_timeouts"] == 1
                assert pool.state()["read"] == "slow"
            else:
                assert first == [0]
                assert pool.state()["read"] == "unreachable"
            answers, slowest = _serve(scheduler, requests[1:], 0.5)
            assert slowest < CALL_BOUND_S
            assert all(a == [0] for a in answers.values())  # at once
            assert pool.cumulative()["lookups_skipped"] >= 3
        finally:
            pool.close()
            if slow is not None:
                slow.stop()


def test_a_slow_pool_resumes_once_it_answers_in_time(server_kind):
    request = _request(0)
    with redis_server("--enable-debug-command", "yes", kind=server_kind) as server:
        _store_chain(server.url, request, 6)
        pool = _pool(server.url, io_threads=False)
        slow = SlowServer(server, 1.0)
        time.sleep(0.2)
        try:
            scheduler = _scheduler(pool)
            answers, _ = _serve(scheduler, [request], 0.3)
            assert answers["r0"][-1] == 0 and pool.state()["read"] == "slow"
            time.sleep(1.5)  # the health thread's PINGs are slow too
            # Still slow (a PING that slipped in between two sleeps may have
            # reopened it for a moment): requests wait at most
            # lookup_wait_s, then compute.
            answers, slowest = _serve(scheduler, [_request(1)], 0.5)
            assert answers["r1"][-1] == 0 and slowest < CALL_BOUND_S
            slow.stop()
            deadline = time.monotonic() + 5
            while pool.state()["read"] != "open" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.state() == {"read": "open", "write": "open"}
            scheduler.request_finished(request, [])
            answers, _ = _serve(scheduler, [request], 0.5)
            assert answers["r0"][-1] == 6 * BLOCK  # all six blocks found
        finally:
            pool.close()


def test_a_hung_server_is_never_used_as_a_probe_and_resumes_after_sigcont(server_kind):
    """While paused, no lookup goes to the network; the health thread's
    PING brings the pool back once the server answers again."""
    request = _request(0)
    with redis_server(kind=server_kind) as server:
        _store_chain(server.url, request, 6)
        pool = _pool(server.url, io_threads=False)
        try:
            scheduler = _scheduler(pool)
            server.pause()
            answers, slowest = _serve(scheduler, [request], 0.3)
            assert answers["r0"][0] is None and answers["r0"][-1] == 0
            assert slowest < CALL_BOUND_S
            scheduler.request_finished(request, [])
            before = pool.cumulative()
            for i in range(50):  # paused: every answer at once, no network
                n, _ = scheduler.get_num_new_matched_tokens(_request(100 + i), 0)
                assert n == 0
            after = pool.cumulative()
            assert after["lookups_skipped"] - before["lookups_skipped"] == 50
            assert after["lookups"] == before["lookups"]
            server.resume()
            deadline = time.monotonic() + 5
            while pool.state()["read"] != "open" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.state()["read"] == "open"
            answers, _ = _serve(scheduler, [request], 0.5)
            assert answers["r0"][-1] == 6 * BLOCK
        finally:
            server.resume()
            pool.close()


def test_one_hung_cluster_node_pauses_the_pool_and_the_client_is_built_once(
    server_kind,
    monkeypatch,
):
    builds = []
    real = pool_module.make_client

    def counting(config, single_node=False):
        builds.append(threading.current_thread().name)
        return real(config, single_node)

    monkeypatch.setattr(pool_module, "make_client", counting)
    requests = [_request(i, blocks=12) for i in range(30)]
    with redis_cluster(kind=server_kind) as servers:
        url = servers[0].url
        pool = _pool(url, io_threads=False, cluster=True)
        try:
            scheduler = _scheduler(pool)
            answers, _ = _serve(scheduler, requests[:1], 0.3)
            # Asked again while the (healthy) lookup ran, then a miss.
            assert answers["r0"][0] is None and answers["r0"][-1] == 0
            assert pool.state()["read"] == "open"
            servers[2].pause()  # 12 blocks: keys on every node
            answers, slowest = _serve(scheduler, requests[1:10], 0.5)
            assert slowest < CALL_BOUND_S
            assert all(a[-1] == 0 for a in answers.values())  # recomputed
            assert pool.cumulative()["lookup_timeouts"] >= 1
            assert pool.state()["read"] == "slow"
            answers, slowest = _serve(scheduler, requests[10:], 1.5)
            assert slowest < CALL_BOUND_S
            assert all(a == [0] for a in answers.values())  # at once
            assert pool.cumulative()["lookups_skipped"] >= 20  # no network
            # One client for lookups, plus the health thread's; never one
            # per lookup.
            assert builds.count("vllm-overlay-pool-lookup") == 1
            assert len(builds) <= 4
            servers[2].resume()
            deadline = time.monotonic() + 8
            while pool.state()["read"] != "open" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.state()["read"] == "open"
        finally:
            servers[2].resume()
            pool.close()


def test_a_full_pool_pauses_writes_only(server_kind):
    with redis_server(
        "--maxmemory", "2mb", "--maxmemory-policy", "noeviction", kind=server_kind
    ) as s:
        pool = _pool(s.url)
        try:
            assert pool.submit_store([(b"first", b"v")]) == 1 and pool.drain()
            big = [(b"k%d" % i, b"x" * 200_000) for i in range(40)]  # 8 MB
            pool.submit_store(big)
            assert pool.drain()
            stats = pool.cumulative()
            assert 0 < stats["stored_blocks"] < 41
            assert pool.state() == {"read": "open", "write": "full"}
            assert pool.store_room(1000) == 0  # the worker copies nothing
            assert pool.submit_store([(b"later", b"v")]) == 0
            assert pool.count_hits([b"first"]) == 1  # reads go on
            s.cli("flushall")
            time.sleep(FAST["retry_backoff_s"] + 0.1)  # the pause ends
            assert pool.state()["write"] == "open"
            assert pool.submit_store([(b"later", b"v")]) == 1 and pool.drain()
            assert pool.count_hits([b"later"]) == 1
        finally:
            pool.close()


def test_a_read_only_replica_pauses_writes_only(server_kind):
    with redis_server(kind=server_kind) as primary:
        primary.cli("set", "there", "v")
        with redis_server(
            "--replicaof", "127.0.0.1", str(primary.port), kind=server_kind
        ) as replica:
            deadline = time.monotonic() + 10
            while replica.cli("get", "there") != "v":
                assert time.monotonic() < deadline, "replica did not sync"
                time.sleep(0.05)
            pool = _pool(replica.url)
            try:
                assert pool.submit_store([(b"k", b"v")]) == 1 and pool.drain()
                assert pool.state() == {"read": "open", "write": "read-only"}
                assert pool.count_hits([b"there"]) == 1
            finally:
                pool.close()


def test_denied_writes_pause_long_and_reads_go_on(server_kind):
    with redis_server(kind=server_kind) as server:
        server.cli(
            "acl", "setuser", "reader", "on", ">secret-pw", "~*", "+@read", "+ping"
        )
        server.cli("set", "there", "v")
        pool = _pool(f"redis://reader:secret-pw@127.0.0.1:{server.port}")
        try:
            assert pool.submit_store([(b"k", b"v")]) == 1 and pool.drain()
            assert pool.state() == {"read": "open", "write": "denied"}
            assert pool._gates.gates["write"].until - time.monotonic() > 0.5  # long
            assert pool.count_hits([b"there"]) == 1
        finally:
            pool.close()


def test_a_wrongtype_key_loses_its_block_only_and_is_deleted(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = _pool(server.url)
        try:
            assert pool.submit_store([(b"a", b"1"), (b"c", b"3")]) == 2
            assert pool.drain()
            server.cli("lpush", "b", "not a string")
            pool.submit_load("job", [b"a", b"b", b"c"])
            assert pool.drain()
            assert pool.poll_loads() == [("job", [b"1", None, b"3"])]
            assert pool.drain()
            assert server.cli("exists", "b") == "0"  # deleted
            stats = pool.cumulative()
            assert stats["bad_keys"] == 1
            assert pool.state() == {"read": "open", "write": "open"}
        finally:
            pool.close()


def test_stores_skip_values_the_pool_has_and_encode_on_the_store_thread(server_kind):
    encoded_on = []

    def encode(key, payload):
        encoded_on.append(threading.current_thread().name)
        return b"E" + bytes(payload)

    with redis_server(kind=server_kind) as server:
        pool = _pool(server.url)
        try:
            assert pool.submit_store([(b"a", b"1")], encode=encode) == 1
            assert pool.drain()
            assert pool.submit_store([(b"a", b"1"), (b"b", b"2")], encode=encode)
            assert pool.drain()
            assert server.cli("get", "a") == "E1" and server.cli("get", "b") == "E2"
            assert encoded_on == ["vllm-overlay-pool-store"] * 2  # not "a" again
            assert pool.cumulative()["skipped_existing"] == 1
        finally:
            pool.close()
