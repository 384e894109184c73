"""SharedKVPoolConnector roles: the scheduler side starts no pool I/O
threads, and an unreachable pool is reported when the connector is created."""

from __future__ import annotations

import logging
import socket
import threading
import time

from vllm_overlay.models.build_tiny_llama import DEFAULT_DIR

IO_THREADS = {"vllm-overlay-pool-store", "vllm-overlay-pool-load"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(role_name: str, url: str):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_overlay.connectors.shared_pool import SharedKVPoolConnector

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(DEFAULT_DIR), dtype="float32", max_model_len=256
        ),
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="SharedKVPoolConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "url": url,
                "connect_timeout_s": 0.5,
                "timeout_s": 0.5,
            },
        ),
    )
    return SharedKVPoolConnector(config, getattr(KVConnectorRole, role_name), None)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_scheduler_role_starts_no_io_threads_and_worker_role_does(overlay):
    url = f"redis://127.0.0.1:{_closed_port()}"
    scheduler = make("SCHEDULER", url)
    try:
        assert scheduler.connector_worker is None
        assert scheduler.connector_scheduler is not None
        assert not _threads() & IO_THREADS
    finally:
        scheduler.shutdown()
    worker = make("WORKER", url)
    try:
        assert worker.connector_scheduler is None
        assert _threads() >= IO_THREADS
    finally:
        worker.shutdown()
    assert not _threads() & IO_THREADS


def test_unreachable_pool_is_reported_at_creation(overlay):
    url = f"redis://user:s3cret@127.0.0.1:{_closed_port()}/0"
    records = _Records()
    logger = logging.getLogger("vllm.overlay")
    logger.addHandler(records)
    try:
        connector = make("SCHEDULER", url)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                "cannot be reached" in m for m in records.messages
            ):
                time.sleep(0.05)
        finally:
            connector.shutdown()
    finally:
        logger.removeHandler(records)
    warnings = [m for m in records.messages if "cannot be reached" in m]
    assert len(warnings) == 1, records.messages
    assert connector.config.redacted_url in warnings[0]
    assert "user:***@127.0.0.1" in warnings[0]
    assert "s3cret" not in warnings[0]


def test_only_the_scheduler_role_probes(overlay):
    """One warning per engine, not one per worker."""
    records = _Records()
    logger = logging.getLogger("vllm.overlay")
    logger.addHandler(records)
    try:
        connector = make("WORKER", f"redis://127.0.0.1:{_closed_port()}")
        connector.shutdown()
        time.sleep(1.0)
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "cannot be reached" in m]


def test_a_request_finished_while_its_load_is_under_way_keeps_its_blocks(
    server_kind, overlay
):
    """A real vLLM Scheduler with the pool connector: a request parked on a
    pool load is aborted; its blocks stay allocated (the load thread may
    still write them) until the worker reports it finished sending."""
    import pathlib
    import sys

    import redis

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
    from support import sched_scenarios as sc
    from support.redis_server import redis_server

    from vllm_overlay.core.pool.keys import pool_key

    with redis_server(kind=server_kind) as server:
        scheduler, request = sc.build(
            "SharedKVPoolConnector", {"url": server.url, "timeout_s": 2.0}
        )
        sched = scheduler()
        side = sched.connector.connector_scheduler
        a = request("A", 40, seed=1)  # two full blocks and 8 tokens
        client = redis.Redis.from_url(server.url)
        for h in side._chain(a)[:2]:
            client.set(pool_key(side.ns, h, 0), b"a value")
        sched.add_request(a)
        pool = sched.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        deadline = time.monotonic() + 10
        while a.status != sc.status("WAITING_FOR_REMOTE_KVS"):
            assert time.monotonic() < deadline, a.status
            out = sched.schedule()  # the lookup answers asynchronously
            assert out.total_num_scheduled_tokens == 0
        assert out.kv_connector_metadata.loads["A"][1] == side._chain(a)[:2]
        held = free_before - pool.get_num_free_blocks()
        assert held == 2  # the two blocks the load writes
        sched.finish_requests("A", sc.status("FINISHED_ABORTED"))
        assert pool.get_num_free_blocks() == free_before - held
        assert "A" in sched.requests
        sc.report_loaded(sched, sched.schedule(), "A", sending=True)
        assert pool.get_num_free_blocks() == free_before
        assert "A" not in sched.requests
        client.close()
