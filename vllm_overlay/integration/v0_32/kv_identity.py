"""What decides a KV chunk's bytes, as the pool's namespace names it (0.32
and 0.33): the configuration part, read in any process, and the engine
part, measured in the workers, kept per engine.

* ``config_factors`` (PT32-01 puts them in the offloading config): vLLM's
  own model-config hash with the model's *location* taken out (its path,
  the weights' path, the revision: the weights are fingerprinted instead,
  so two mounts of one folder share and two revisions do not), the
  quantization, the cache config's hash, the prefix hash algorithm, the
  LoRA config and the release's chunk format (``LAYOUT_VERSION``).
* The engine part (``EngineIdentity``): every worker's weights fingerprint
  and the attention backend's in-page layout, measured by writing probe
  tokens through the backend's own KV-cache write (``worker_identity``).
  The engine core measures it at start-up and again after every
  prefix-cache reset and every RPC to the workers (``patch_engine_core``'s
  KI32-01/02/03); a changed weights fingerprint re-keys every pool tier of
  that engine at once.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
import weakref

logger = logging.getLogger("vllm.overlay")

KV_IDENTITY = "kv_identity"
# The engine part's factor names (also accepted ready-made in the offloading
# config's kv_identity, as tests and stand-ins give them).
WEIGHTS, PAGES = "weights=", "pages="
# The chunk format of each release the tier runs on: a release whose chunks
# could differ gets its own version (the gate refuses unrecorded releases).
LAYOUT_VERSION = {"0.32": "vllm-0.32/chunks-1", "0.33": "vllm-0.33/chunks-1"}


def layout_version() -> str:
    import vllm

    release = ".".join(vllm.__version__.split(".")[:2])
    try:
        return LAYOUT_VERSION[release]
    except KeyError:
        raise RuntimeError(
            "vllm-overlay: no pool chunk format is recorded for vLLM "
            + vllm.__version__
        ) from None


def _without_location(model_config):
    """A copy of ``model_config`` whose hash no longer sees where the model
    was loaded from: ``model``/``model_weights`` and the HF config's
    ``_name_or_path`` (any string field equal to the model's path, such as
    ``tokenizer`` or ``generation_config``, too), and the revision."""
    path = model_config.model
    clone = copy.copy(model_config)
    for name, value in list(vars(model_config).items()):
        if (
            isinstance(value, str)
            and value
            and value in (path, model_config.model_weights)
        ):
            object.__setattr__(clone, name, "<weights>")
    for name in ("revision", "code_revision"):
        if hasattr(clone, name):
            object.__setattr__(clone, name, None)
    for name in ("hf_config", "hf_text_config"):
        hf = getattr(model_config, name, None)
        if hf is not None and getattr(hf, "_name_or_path", None) is not None:
            hf = copy.copy(hf)
            hf._name_or_path = ""
            object.__setattr__(clone, name, hf)
    return clone


def config_factors(vllm_config) -> list[str]:
    """What decides a block's KV bytes in the configuration, beyond the
    offloading config's own fields (groups, block sizes, parallel sizes,
    KV dtype)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    lora = getattr(vllm_config, "lora_config", None)
    return [
        f"model-hash={_without_location(model).compute_hash()}",
        f"quantization={model.quantization}",
        f"cache-hash={cache.compute_hash()}",
        f"hash-algo={cache.prefix_caching_hash_algo}",
        f"lora={lora.compute_hash() if lora is not None else None}",
        f"format={layout_version()}",
    ]


class EngineIdentity:
    """One engine's measured part: its workers' weights and page layouts.
    The engine core sets it; pool tiers of that engine read it and are
    told when it changes (on the engine's thread, after a reset or an RPC
    to the workers: ``measure``)."""

    def __init__(self) -> None:
        self.weights: str | None = None
        self.pages: str | None = None
        self._tiers: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()

    def factors(self) -> list[str]:
        if self.weights is None or self.pages is None:
            return []
        return [WEIGHTS + self.weights, PAGES + self.pages]

    def subscribe(self, tier) -> None:
        with self._lock:
            self._tiers.add(tier)

    def update(self, weights: str, pages: str) -> bool:
        """Record a measurement; True when it changed (tiers re-keyed)."""
        changed = (weights, pages) != (self.weights, self.pages)
        known = self.weights is not None
        self.weights, self.pages = weights, pages
        if changed and known:
            with self._lock:
                tiers = list(self._tiers)
            for tier in tiers:
                tier.rekey(self.factors())
        return changed


_ENGINES: dict[str, EngineIdentity] = {}
_ENGINES_LOCK = threading.Lock()


def engine(engine_id: str) -> EngineIdentity:
    """The identity of the engine ``engine_id`` (its KV transfer config's
    engine id, which the offloading config carries) in this process."""
    with _ENGINES_LOCK:
        return _ENGINES.setdefault(engine_id, EngineIdentity())


def combine(results: list[dict]) -> tuple[str, str]:
    """The workers' answers (rank order) as the engine's two factors."""
    weights = hashlib.blake2b(digest_size=16)
    pages = set()
    for result in results:
        weights.update(result["weights"].encode())
        pages.update(result["pages"])
    return weights.hexdigest(), ";".join(sorted(pages))


def _secondary_tiers(transfer) -> bool:
    """Whether a KV transfer config (MultiConnector's nested ones too) has
    secondary tiers, which a shared pool is one of."""
    key = "kv_connector_extra_config"
    if isinstance(transfer, dict):
        extra = transfer.get(key)
    else:
        extra = getattr(transfer, key, None)
    if not isinstance(extra, dict):
        return False
    nested = extra.get("connectors") or []
    return bool(extra.get("secondary_tiers")) or any(map(_secondary_tiers, nested))


def measure(engine_core, vllm_config=None) -> None:
    """Measure the engine part in the workers (``worker_identity``) and
    record it for this engine's pool tiers; only when secondary tiers are
    configured.  Runs on the engine's thread between steps: at start-up,
    after each prefix-cache reset (where vLLM expects new weights to take
    effect) and after each RPC to the workers (through which weights are
    changed in place)."""
    import time

    from vllm_overlay.integration.v0_32.worker_identity import worker_identity

    config = vllm_config if vllm_config is not None else engine_core.vllm_config
    transfer = config.kv_transfer_config
    if not _secondary_tiers(transfer):
        return
    start = time.monotonic()
    identity = engine(transfer.engine_id)
    first = identity.weights is None
    try:
        results = engine_core.model_executor.collective_rpc(worker_identity)
    except Exception:
        if first:
            raise  # a start-up error: the tier cannot know what it holds
        # The weights may have changed and cannot be named: a namespace of
        # this engine's own from now on, shared with no node.
        logger.exception(
            "vllm-overlay KV identity: measuring the workers failed; the pool "
            "tier moves to a namespace no other node shares"
        )
        identity.update("unmeasured-" + os.urandom(8).hex(), identity.pages)
        return
    weights, pages = combine(results)
    changed = identity.update(weights, pages)
    if first or changed:
        logger.info(
            "vllm-overlay KV identity (%s): weights %s, page layout %s, %d worker(s), "
            "measured in %.2f s",
            "start-up" if first else "changed",
            weights[:12],
            pages,
            len(results),
            time.monotonic() - start,
        )
