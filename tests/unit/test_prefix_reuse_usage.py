"""The prefix-reuse benchmark's read accounting (benchmarks/prefix_reuse_usage.py):
its spans nest so that even a load as short as the accounting's own reads of
/proc never shows more time on a core than the read's wall time."""

from __future__ import annotations

import gc
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefix_reuse_usage import LoadUsage, read_usage  # noqa: E402

from vllm_overlay.core.pool.pool import KVPool  # noqa: E402


def test_short_loads_never_show_more_cpu_than_wall(monkeypatch):
    calls = []

    def _load(pool, client, job):  # a load with next to no work of its own
        calls.append(job)
        return job * 2

    monkeypatch.setattr(KVPool, "_load", _load)
    usage = LoadUsage(server_pid=None)
    try:
        for job in range(300):
            assert KVPool._load(None, None, job) == job * 2
            one = usage.take()
            assert one["wall_s"] >= one["cpu_s"] > 0, one
            assert one["runq_s"] >= 0 and one["minflt"] >= 0, one
            split = read_usage({"read_usage": one})
            assert split["wall_ms"] >= split["cpu_ms"], split
        assert calls == list(range(300))
    finally:
        gc.callbacks.remove(usage._collecting)
