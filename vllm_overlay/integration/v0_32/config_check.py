"""Front-end checks of configurations that vLLM 0.32 takes at startup and
fails on only after the model loaded (or on the first request).

``EngineArgs.create_engine_config`` (patch PP32-03, in the process that
parses the arguments, before any engine process starts) asks
``refusal(config)``; a configuration named here is refused
with one line naming the key and the fix:

* ``cpu_bytes_to_use`` of upstream's ``OffloadingConnector`` (also inside
  a ``MultiConnector``): a whole number of bytes, at least 1 and at most
  this machine's memory (the smaller of the physical memory and the
  cgroup's ``memory.max``).  Upstream reads it only when the engine core
  builds the offloading spec: a negative value fails in ``torch.zeros``, a
  huge one in the allocator, neither naming the key.
* the overlay's pool tier in ``secondary_tiers``: its options as the tier
  gets them from upstream's ``SecondaryTierFactory`` (less ``type``,
  ``module_path`` and ``backpressure``), checked by ``PoolConfig``
  (vLLM-free) now rather than in the engine core after the model loaded.
* pipeline parallelism with compilation mode NONE (``--enforce-eager``) on
  the CPU platform: vLLM 0.32's CPU worker warms the model up only when it
  compiles, so the later stages never allocate their intermediate-tensor
  buffers and the first request kills the engine
  (``assert self.intermediate_tensors is not None``), in stock 0.32 too.
"""

from __future__ import annotations

import os

from vllm_overlay.features import POOL_TIER_CLASS, POOL_TIER_MODULE


class ConfigRefused(ValueError):
    """A configuration refused here (its message: the key and the fix);
    uncaught, it prints as that one line (``startup_errors``)."""

    one_line_startup_error = True


# Specs of upstream's OffloadingConnector that read cpu_bytes_to_use.
HOST_MEMORY_SPECS = (None, "CPUOffloadingSpec", "TieringOffloadingSpec")
# Keys upstream's SecondaryTierFactory takes out before it builds a tier.
FACTORY_KEYS = ("type", "module_path", "backpressure")
GiB = 2**30
WHERE = "--kv-transfer-config"


def machine_memory_bytes() -> int:
    """This machine's memory for the engine: the physical memory, or the
    cgroup (v2) limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _connectors(kv_transfer_config) -> list[tuple[str, str | None, dict]]:
    """(where, connector name, extra config) of the connector and, in a
    MultiConnector, of each connector it holds."""
    if kv_transfer_config is None:
        return []
    extra = kv_transfer_config.kv_connector_extra_config or {}
    found = [("kv_connector_extra_config", kv_transfer_config.kv_connector, extra)]
    if kv_transfer_config.kv_connector == "MultiConnector":
        for i, inner in enumerate(extra.get("connectors") or []):
            if isinstance(inner, dict):
                found.append(
                    (
                        f"kv_connector_extra_config.connectors[{i}]"
                        ".kv_connector_extra_config",
                        inner.get("kv_connector"),
                        inner.get("kv_connector_extra_config") or {},
                    )
                )
    return found


def host_bytes_refusal(where: str, extra: dict, memory: int) -> str | None:
    """``cpu_bytes_to_use`` of an OffloadingConnector's extra config."""
    key = f"{WHERE}: {where}['cpu_bytes_to_use']"
    value = extra.get("cpu_bytes_to_use")
    example = "e.g. 8589934592 or 8G for 8 GiB"
    if value is None:
        return (
            f"{key} is missing: give the bytes of host memory for offloaded "
            f"KV ({example})"
        )
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(type(value).__name__)
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return f"{key} must be a whole number of bytes, got {value!r} ({example})"
    if number <= 0:
        return (
            f"{key} is {value!r}: give a positive number of bytes of host "
            f"memory for offloaded KV ({example})"
        )
    if number > memory:
        return (
            f"{key} is {number} B ({number / GiB:.1f} GiB), more than this "
            f"machine's memory ({memory} B, {memory / GiB:.1f} GiB): lower it"
        )
    return None


def pool_tier_refusal(where: str, index: int, tier) -> str | None:
    """The overlay's pool tier in ``secondary_tiers``: its options."""
    key = f"{WHERE}: {where}['secondary_tiers'][{index}]"
    if not isinstance(tier, dict) or tier.get("module_path") != POOL_TIER_MODULE:
        return None
    if tier.get("type") != POOL_TIER_CLASS:
        return (
            f"{key}: module_path {POOL_TIER_MODULE!r} holds the tier "
            f"{POOL_TIER_CLASS!r}, not type {tier.get('type')!r}: set "
            f'"type": "{POOL_TIER_CLASS}"'
        )
    from vllm_overlay.core.pool.config import PoolConfig, tier_options

    options = {k: v for k, v in tier.items() if k not in FACTORY_KEYS}
    try:
        PoolConfig.from_dict(tier_options(options)[0])  # less locality
    except (TypeError, ValueError) as exc:
        return f"{key} ({POOL_TIER_CLASS}): {exc}"
    return None


def offloading_refusal(kv_transfer_config, memory: int | None = None) -> str | None:
    """The first bad offloading setting of the KV transfer config."""
    for where, name, extra in _connectors(kv_transfer_config):
        if name != "OffloadingConnector":
            continue
        if extra.get("spec_name") in HOST_MEMORY_SPECS:
            memory = machine_memory_bytes() if memory is None else memory
            error = host_bytes_refusal(where, extra, memory)
            if error:
                return error
        for index, tier in enumerate(extra.get("secondary_tiers") or []):
            error = pool_tier_refusal(where, index, tier)
            if error:
                return error
    return None


def pp_eager_refusal(vllm_config) -> str | None:
    """PP > 1 on the CPU platform without compilation (vLLM 0.32)."""
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp <= 1 or not current_platform.is_cpu():
        return None
    if vllm_config.compilation_config.mode != CompilationMode.NONE:
        return None
    model = vllm_config.model_config
    if model is not None and model.enforce_eager:
        what = "--enforce-eager"
        fix = "remove --enforce-eager (compilation on, e.g. -cc.mode=1)"
    else:
        what = "compilation mode NONE (-cc.mode=0)"
        fix = "turn compilation on (e.g. -cc.mode=1)"
    return (
        f"--pipeline-parallel-size {pp} with {what} is a vLLM 0.32 CPU limit: "
        "without compilation the CPU worker skips its warm-up, the later "
        "stages never allocate their intermediate-tensor buffers and the "
        "first request kills the engine (assert self.intermediate_tensors is "
        f"not None): {fix} or use --pipeline-parallel-size 1"
    )


def refusal(vllm_config) -> str | None:
    """The first configuration error of the checks above, else None."""
    return offloading_refusal(vllm_config.kv_transfer_config) or pp_eager_refusal(
        vllm_config
    )
