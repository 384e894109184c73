"""What two engines must share for one to load the other's blocks from the
pool: the namespace factors of a 0.32 offloading config.

A value is one chunk of the primary (host) tier: the bytes of
``blocks_per_chunk`` blocks of every KV group, every worker's in rank
order, as upstream's host tier lays them out: in a worker's slot, tensor
after tensor, each tensor's blocks back to back (``CHUNK_ORDER``;
upstream's ``cpu/gpu_worker.py`` and, on CPU, ``integration/v0_32/
offload_worker.py``).  Until issue 27 the overlay's CPU worker put block
after block, in values whose factors named no order; ``CHUNK_ORDER`` keeps
those out of the new namespace, and its layout tag refuses them.  With more
than one block per chunk the chunk then depends on the device's KV tensors:
per-layer tensors fill it layer by layer, one cross-layer (``BLHNC``)
tensor block by block; ``kv-cache-layout`` (upstream's resolved layout
name) keeps those apart.  Everything else that shapes the bytes is a
factor too."""

from __future__ import annotations

from vllm_overlay.integration.v0_32.kv_identity import KV_IDENTITY, PAGES, WEIGHTS

FORMAT = "vllm-shared-kv-pool-tier/1"
# Inside a worker's slot of a chunk: each KV tensor's blocks_per_chunk pages
# back to back, tensor after tensor (upstream's create_next_worker_view /
# create_next_canonical_view, one per tensor in tensor order).
CHUNK_ORDER = "chunk-order=tensor-major"


def host_layout(config) -> str:
    kind = "canonical" if config.canonical_layout else "direct"
    return kind + ("/replicated" if config.replicated_layout else "")


def with_engine(identity: list[str], engine: list[str]) -> list[str]:
    """``identity`` with its engine part (weights, pages) replaced by
    ``engine`` (kept when ``engine`` is empty)."""
    if not engine:
        return list(identity)
    kept = [f for f in identity if not f.startswith((WEIGHTS, PAGES))]
    return kept + list(engine)


def tier_factors(
    config, chunk_bytes: int, user_namespace: str, engine: list[str] = ()
) -> list[str]:
    """``config``: the spec's ``OffloadingConfig``; ``chunk_bytes``: one
    primary chunk (the tier's ``block_size_bytes``); ``engine``: the
    engine's measured part (``kv_identity.EngineIdentity.factors``), when
    the offloading config does not carry it."""
    given = config.extra_config.get(KV_IDENTITY) or []
    identity = with_engine(given, engine)
    # The configuration's part is PT32-01's alone (the engine's part does
    # not stand in for it).
    if not [f for f in given if not f.startswith((WEIGHTS, PAGES))]:
        raise ValueError(
            "SharedPoolTier: the offloading config does not name the model "
            f"config its KV comes from (extra_config[{KV_IDENTITY!r}], set by "
            "the overlay's patch PT32-01); without it engines with other "
            "weights, revisions or RoPE overrides would share blocks. Is "
            "vllm-overlay's plugin loaded (VLLM_OVERLAY_DISABLE unset, "
            "PT32-01 not skipped)?"
        )
    missing = [
        f for f in (WEIGHTS, PAGES) if not any(x.startswith(f) for x in identity)
    ]
    if missing:
        raise ValueError(
            "SharedPoolTier: the engine's "
            + " and ".join(
                {WEIGHTS: "weights fingerprint", PAGES: "page layout"}[f]
                for f in missing
            )
            + " are not known (measured in the workers at start-up by the "
            "overlay's patch KI32-01); without them a node with other weights "
            "or another in-page KV layout would share blocks. Is KI32-01 "
            "skipped (VLLM_OVERLAY_SKIP_PATCHES)?"
        )
    parallel = config.parallel
    groups = ";".join(
        f"{g.group_id}:{g.tokens_per_block}t:{len(g.layer_names)}l"
        for g in config.groups
    )
    return [
        FORMAT,
        *identity,
        f"kv-dtype={config.model.dtype}",
        f"groups={groups}",
        f"worker-bytes-per-block={config.worker_kv_bytes_per_block}",
        f"tokens-per-hash={config.cache.tokens_per_hash}",
        f"blocks-per-chunk={config.cache.blocks_per_chunk}",
        f"parallel=tp{parallel.tp_size}/pp{parallel.pp_size}/pcp{parallel.pcp_size}"
        f"/dcp{parallel.dcp_size}/world{parallel.world_size}",
        f"host-layout={host_layout(config)}",
        CHUNK_ORDER,
        f"kv-cache-layout={config.kv_cache_layout}",
        f"chunk-bytes={chunk_bytes}",
        f"namespace={user_namespace}",
    ]


def layout_description(config, chunk_bytes: int) -> str:
    """The value header's layout fingerprint (checked on every load)."""
    return (
        f"tier-chunk|{host_layout(config)}|{CHUNK_ORDER}"
        f"|kv-cache-layout={config.kv_cache_layout}|chunk-bytes={chunk_bytes}"
    )
