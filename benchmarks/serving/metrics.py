"""Cache hit tokens by source, from a node's own Prometheus metrics
(``GET /metrics`` of ``vllm serve``).

vLLM 0.32 counts prompt tokens served from a cache by the tier that
supplied them: ``vllm:prompt_tokens_cached_by_source{source=...}``
(``vllm/v1/metrics/loggers.py``; the sources are ``CacheHitSource`` in
``vllm/v1/metrics/cache_hit_source.py``: ``device`` for the engine's own
prefix cache, ``host`` for the offloading connector's CPU primary tier,
and a secondary tier's own source, ``external_unspecified`` unless the
tier names one).  Here ``pool`` is every source but ``device`` and
``host``: the benchmark's only secondary tier is the pool.

vLLM 0.11.2 has no per-source counter: ``vllm:prefix_cache_hits`` (the
device prefix cache) and ``vllm:external_prefix_cache_hits`` (whatever the
KV connector supplied: host and pool together, reported as ``external``).
Where the overlay's 0.11.2 connectors export their own counters
(``vllm:overlay_pool_loaded_blocks``: blocks the pool connector loaded,
which MultiConnector's host connector then loads from host memory), the
pool's share is those blocks' tokens and the host's the rest.
"""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
DEVICE_0112 = "vllm:prefix_cache_hits"
EXTERNAL_0112 = "vllm:external_prefix_cache_hits"
PROMPT_TOKENS = "vllm:prompt_tokens"
BY_ORIGIN = "vllm:prompt_tokens_by_source"  # 0.32: local_compute, ...
FINISHED = "vllm:request_success"
COLUMNS = ("device", "host", "pool", "external")
POOL_TIER = "vllm:kv_offload_pool_"  # the overlay's pool tier (0.32)
POOL_LOADED_0112 = "vllm:overlay_pool_loaded_blocks"  # its 0.11.2 connector


def scrape(port: int, timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    """Counter totals by name; per name, the samples summed by ``source``
    label (``""`` when the sample has none)."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics", timeout=timeout_s
    ) as reply:
        text = reply.read().decode()
    return parse(text)


def parse(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name.removesuffix("_total")
            source = sample.labels.get("source", "")
            by = out.setdefault(name, {})
            by[source] = by.get(source, 0.0) + sample.value
    return out


def delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {
        name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in by.items()}
        for name, by in after.items()
    }


def total(counters: dict, name: str) -> float:
    return sum(counters.get(name, {}).values())


def hits(counters: dict, block: int = 128, cached: int | None = None) -> dict:
    """Hit tokens by column (device / host / pool / external) and the raw
    per-source counts, from one node's counters (or a delta); ``block``:
    tokens per KV block; ``cached``: the cached tokens the node's answers
    reported (``usage.prompt_tokens_details``), summed."""
    out = dict.fromkeys(COLUMNS, 0)
    if BY_SOURCE in counters:  # 0.32
        raw = {k: int(v) for k, v in counters[BY_SOURCE].items() if v}
        for source, n in raw.items():
            out[source if source in ("device", "host") else "pool"] += n
        out["raw"] = raw
    else:  # 0.11.2
        out["device"] = int(total(counters, DEVICE_0112))
        out["external"] = int(total(counters, EXTERNAL_0112))
        if POOL_LOADED_0112 in counters:
            pool = int(total(counters, POOL_LOADED_0112)) * block
            out["pool"], out["host"] = pool, max(out["external"] - pool, 0)
        if cached is not None:
            # 0.11.2 counts device hits at every lookup of a request, and a
            # request whose connector lookup is pending (None) is looked up
            # again the next step (scheduler.schedule): the device's share
            # is what the answers say was cached minus the external part.
            out["device_counter"] = out["device"]
            out["device"] = max(cached - out["external"], 0)
    out["prompt_tokens"] = int(total(counters, PROMPT_TOKENS))
    if cached is not None:
        out["cached"] = cached
        out["computed"] = out["prompt_tokens"] - cached
    if BY_ORIGIN in counters:  # 0.32: prompt tokens prefilled here
        out["computed"] = int(counters[BY_ORIGIN].get("local_compute", 0))
    pool = {
        name.removeprefix(POOL_TIER): int(total(counters, name))
        for name in counters
        if name.startswith(POOL_TIER)
    }
    if pool:  # its lookups, loads, stores, failures by kind, pauses
        out["pool_tier"] = pool
    return out


def finished(counters: dict) -> int:
    return int(total(counters, FINISHED))


def add(per_node: list[dict]) -> dict:
    """The nodes' counts summed (per-source and pool-tier counts too)."""
    out: dict = {}
    for node in per_node:
        for key, value in node.items():
            if isinstance(value, dict):
                into = out.setdefault(key, {})
                for k, n in value.items():
                    into[k] = into.get(k, 0) + n
            else:
                out[key] = out.get(key, 0) + value
    return out


def wait_finished(
    ports: list[int], before: list[dict], routed: list[int], deadline_s: float = 60.0
) -> list[dict]:
    """The nodes' counters once each counts the requests routed to it as
    finished (the counters are updated as the engine reports them)."""
    deadline = time.monotonic() + deadline_s
    while True:
        after = [scrape(port) for port in ports]
        done = [finished(a) - finished(b) for a, b in zip(after, before)]
        if all(d >= n for d, n in zip(done, routed)):
            return after
        if time.monotonic() > deadline:
            raise TimeoutError(f"finished requests {done}, routed {routed}")
        time.sleep(0.5)
