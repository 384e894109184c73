"""The pool namespace fingerprints everything that decides the KV bytes:
two configs that differ in one such field never share a namespace, equal
configs always do (in any process, whatever PYTHONHASHSEED).  Configs are
built without starting an engine."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from vllm_overlay.models.build_tiny_llama import DEFAULT_DIR


def make_config(**model_kwargs):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=str(DEFAULT_DIR),
            dtype=model_kwargs.pop("dtype", "float32"),
            max_model_len=256,
            **model_kwargs,
        ),
        cache_config=CacheConfig(block_size=16),
    )


@pytest.fixture(scope="module")
def base():
    return make_config()


def ns(config, user="default"):
    from vllm_overlay.connectors.shared_pool.common import namespace_tag

    return namespace_tag(config, user).hex()


def _changed(config, section: str, name: str, value):
    config = copy.deepcopy(config)
    target = getattr(config, section)
    object.__setattr__(target, name, value)
    return config


@pytest.mark.parametrize(
    "section,name,value",
    [
        ("model_config", "model", "/elsewhere/tiny_llama"),
        ("model_config", "revision", "v2"),
        ("model_config", "quantization", "fp8"),
        ("model_config", "dtype", torch.bfloat16),
        ("cache_config", "cache_dtype", "fp8_e4m3"),
        ("cache_config", "block_size", 32),
        ("cache_config", "prefix_caching_hash_algo", "sha256_cbor"),
        ("parallel_config", "tensor_parallel_size", 2),
        ("parallel_config", "pipeline_parallel_size", 2),
    ],
)
def test_each_field_changes_the_namespace(base, section, name, value, overlay):
    assert ns(_changed(base, section, name, value)) != ns(base)


def test_hf_overrides_rope_scaling_changes_the_namespace(base, overlay):
    other = make_config(hf_overrides={"rope_theta": 5000.0})
    assert other.model_config.hf_config.rope_theta == 5000.0
    assert ns(other) != ns(base)


def test_lora_changes_the_namespace(base, overlay):
    from vllm.config import LoRAConfig

    one = copy.deepcopy(base)
    object.__setattr__(one, "lora_config", LoRAConfig(max_lora_rank=8))
    two = copy.deepcopy(base)
    object.__setattr__(two, "lora_config", LoRAConfig(max_lora_rank=16))
    assert len({ns(base), ns(one), ns(two)}) == 3


def test_user_namespace_changes_it(base, overlay):
    assert ns(base, "team-a") != ns(base, "team-b")


@pytest.mark.parametrize(
    "env",
    [
        {"VLLM_OVERLAY_SKIP_PATCHES": "CL-09"},
        {"VLLM_OVERLAY_SKIP_PATCHES": "KV-01, CL-10"},
    ],
)
def test_cross_layer_off_changes_the_namespace(base, env, monkeypatch, overlay):
    before = ns(base)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from vllm_overlay.connectors.shared_pool.common import layout_descriptor

    assert "cross-layer=off" in layout_descriptor(base)
    assert ns(base) != before


def test_equal_configs_give_equal_namespaces(base, overlay):
    assert ns(make_config()) == ns(base) == ns(copy.deepcopy(base))


def test_which_fields_vllm_hashes_cover(base):
    """vLLM 0.11.2: ModelConfig.compute_hash covers revision, quantization,
    dtype and hf_overrides; CacheConfig.compute_hash covers the KV cache
    dtype but not the block size or hash algorithm; the parallel sizes are
    in neither: namespace_factors adds those explicitly."""
    model_hash = base.model_config.compute_hash()
    for name, value in (
        ("revision", "v2"),
        ("quantization", "fp8"),
        ("dtype", torch.bfloat16),
    ):
        changed = _changed(base, "model_config", name, value)
        assert changed.model_config.compute_hash() != model_hash, name
    other = make_config(hf_overrides={"rope_theta": 5000.0})
    assert other.model_config.compute_hash() != model_hash
    cache_hash = base.cache_config.compute_hash()
    assert (
        _changed(base, "cache_config", "cache_dtype", "fp8").cache_config.compute_hash()
        != cache_hash
    )
    for name, value in (("block_size", 32), ("prefix_caching_hash_algo", "sha256")):
        changed = _changed(base, "cache_config", name, value)
        assert changed.cache_config.compute_hash() == cache_hash, name


def test_namespace_is_stable_across_processes(base, overlay):
    code = (
        "from tests.unit.test_pool_namespace import make_config, ns;"
        "import vllm_overlay; vllm_overlay.register(); print(ns(make_config()))"
    )
    results = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(DEFAULT_DIR.parents[2]), env.get("PYTHONPATH", "")]
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(DEFAULT_DIR.parents[2]),
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        results.add(out.stdout.strip().splitlines()[-1])
    assert results == {ns(base)}


def _chain(lora_request, request_id="r"):
    import types

    from vllm_overlay.connectors.shared_pool.scheduler import SharedPoolScheduler

    config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(
            block_size=4, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=types.SimpleNamespace(world_size=1),
    )
    scheduler = SharedPoolScheduler(config, b"n" * 16, pool=None)
    request = types.SimpleNamespace(
        request_id=request_id,
        all_token_ids=list(range(12)),
        mm_features=[],
        lora_request=lora_request,
        cache_salt=None,
        prompt_embeds=None,
    )
    return scheduler._chain(request)


def test_a_lora_is_keyed_by_name_and_by_where_it_came_from():
    """vLLM keys a LoRA by name only; two nodes may load different adapters
    under one name, so the pool chain also covers the adapter's path."""
    from vllm.lora.request import LoRARequest

    plain = _chain(None)
    a = _chain(LoRARequest("sql", 1, "/adapters/sql-v1"))
    assert len(plain) == 3
    assert a == _chain(LoRARequest("sql", 7, "/adapters/sql-v1"), "other")
    assert a != plain
    assert a != _chain(LoRARequest("sql", 1, "/adapters/sql-v2"))
    assert a != _chain(LoRARequest("chat", 1, "/adapters/sql-v1"))


def test_attention_backend_and_kv_layout_change_the_namespace(
    base, monkeypatch, overlay
):
    import vllm.attention.selector as selector
    import vllm.v1.attention.backends.utils as backend_utils

    before = ns(base)
    monkeypatch.setattr(backend_utils, "get_kv_cache_layout", lambda: "HND")
    hnd = ns(base)
    real = selector.get_attn_backend

    class Other:
        @staticmethod
        def get_name():
            return "OTHER_ATTN"

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            raise NotImplementedError

    monkeypatch.setattr(selector, "get_attn_backend", lambda *a, **k: Other)
    other = ns(base)
    monkeypatch.setattr(selector, "get_attn_backend", real)
    assert len({before, hnd, other}) == 3


def test_value_layout_fingerprint_tells_per_layer_from_cross_layer():
    """Equal block sizes, different layouts: different header fingerprints,
    so a per-layer value is refused by a cross-layer node (and back)."""
    import types

    from vllm_overlay.connectors.shared_pool.common import table_layout_tag

    table = types.SimpleNamespace(block_bytes=4096, runs_per_block=1)
    tags = {
        table_layout_tag("cross-layer", table, "dims=(blocks, layers, ...)"),
        table_layout_tag("per-layer", table, "kv-layout=HND"),
        table_layout_tag("per-layer", table, "kv-layout=NHD"),
    }
    assert len(tags) == 3
    assert table_layout_tag("per-layer", table, "x") == table_layout_tag(
        "per-layer", table, "x"
    )
