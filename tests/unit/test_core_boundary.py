"""vllm_overlay.core imports no vLLM: every module under it imports in a
process where ``import vllm`` fails."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, importlib.abc, json, pkgutil, sys

class BlockVLLM(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"{name} is blocked: the core must not import vLLM")
        return None

sys.meta_path.insert(0, BlockVLLM())
import vllm_overlay.core as core

result = {}
for info in pkgutil.walk_packages(core.__path__, core.__name__ + "."):
    try:
        importlib.import_module(info.name)
        result[info.name] = None
    except Exception as exc:
        result[info.name] = f"{type(exc).__name__}: {exc}"
result["vllm loaded"] = sorted(m for m in sys.modules
                               if m == "vllm" or m.startswith("vllm."))
print(json.dumps(result))
"""


def test_every_core_module_imports_without_vllm():
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("vllm loaded") == []
    expected = {
        f"vllm_overlay.core.{name}"
        for name in (
            "idle_wait",
            "kv_layout",
            "patching",
            "pp_budget",
            "ops",
            "ops.block_copy",
            "ops.triton_kernels",
            "offload",
            "offload.host_copy",
            "offload.mapping",
            "offload.mover",
            "pool",
            "pool.codec",
            "pool.config",
            "pool.errors",
            "pool.failures",
            "pool.flights",
            "pool.health",
            "pool.jobs",
            "pool.keys",
            "pool.loads",
            "pool.lookups",
            "pool.pool",
            "pool.ratelog",
            "pool.refusals",
            "pool.resp",
            "pool.stats",
            "pool.stores",
            "pool.transport",
        )
    }
    assert set(result) == expected
    failed = {name: error for name, error in result.items() if error}
    assert not failed, failed
