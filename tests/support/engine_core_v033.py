"""vLLM 0.33's engine core sizing the KV cache over a stand-in executor
(no 0.33 engine runs here: no kernels in its Python-only build): the
workers' answers as 0.33's GPU worker gives them, everything from there on
0.33's own ``EngineCore._initialize_kv_caches``."""

from __future__ import annotations


def worker_specs(config) -> list[dict]:
    """Each PP stage's KV specs as its worker reports them: one full
    attention spec per layer it holds, under vLLM's layer names."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model, parallel = config.model_config, config.parallel_config
    layers = model.hf_config.num_hidden_layers
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=model.dtype,
    )
    stages = []
    for rank in range(parallel.pipeline_parallel_size):
        start, end = get_pp_indices(layers, rank, parallel.pipeline_parallel_size)
        stages.append(
            {f"model.layers.{i}.self_attn.attn": spec for i in range(start, end)}
        )
    return stages


def page_bytes(config) -> int:
    (spec, *_) = worker_specs(config)[0].values()
    return spec.page_size_bytes


class Executor:
    """What 0.33's engine core asks its executor while it sizes the KV
    cache, answered as two PP workers would (each reports the whole
    ``kv_cache_memory_bytes``, as 0.33's GPU worker does); the configs
    it is handed are kept."""

    def __init__(self, config) -> None:
        self.specs = worker_specs(config)
        self.memory = [config.cache_config.kv_cache_memory_bytes] * len(self.specs)
        self.configs = None

    def get_kv_cache_specs(self):
        return self.specs

    def determine_available_memory(self):
        return list(self.memory)

    def get_supported_kv_cache_layouts(self):
        # per worker, the layouts its attention backends support (a
        # per-layer backend's, most preferred first)
        return [["LBNHC", "LBHNC"] for _ in self.specs]

    def set_kv_cache_layout(self, *args):
        pass

    def initialize_from_config(self, kv_cache_configs):
        self.configs = kv_cache_configs

    def compile_or_warm_up_model(self):
        pass


def initialize(config):
    """0.33's ``EngineCore._initialize_kv_caches`` over the stand-in
    executor: each worker's KV cache config as the engine hands it out."""
    import types

    from vllm.v1.engine.core import EngineCore

    executor = Executor(config)
    core = types.SimpleNamespace(
        model_executor=executor, collective_rpc=lambda *a, **k: None
    )
    EngineCore._initialize_kv_caches(core, config)
    return executor.configs
