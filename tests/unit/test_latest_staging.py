"""patches/latest: pp-kv-budget and shared-pool staged on the newest vLLM
release by patches/tools/stage_latest.py (from the 0.11.2 series)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "patches" / "tools"
LATEST = ROOT / "patches" / "latest"
sys.path.insert(0, str(TOOLS))
import fetch_sdist  # noqa: E402
import stage_latest  # noqa: E402


def _sdist_or_skip() -> pathlib.Path:
    version = stage_latest.LATEST_VERSION
    hit = fetch_sdist.cached(version)
    if hit is None:
        try:
            hit = fetch_sdist.fetch(version)
        except Exception as exc:  # no network: nothing to check against
            pytest.skip(
                f"the vLLM {version} sdist is not cached in "
                f"{fetch_sdist.cache_dir()} and cannot be downloaded ({exc}); "
                f"run python patches/tools/fetch_sdist.py --version {version}"
            )
    return hit


def test_staging_is_current_applies_compiles_and_passes_the_hooks():
    """``stage_latest.py --verify``: patches/latest equals a fresh staging
    byte for byte (imports of the staged files resolve in the newest sdist),
    every diff applies in order with ``git apply --check`` and ``patch
    --dry-run -p1 -F0`` (no fuzz, no offset), the newest release's offline
    pre-commit hooks pass and every touched file compiles.  Offline: a
    pinned tool not at hand is skipped, not installed."""
    _sdist_or_skip()
    done = subprocess.run(
        [sys.executable, str(TOOLS / "stage_latest.py"), "--verify", "--offline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "patches/latest is up to date" in out
    assert "| FAIL |" not in out
    for hook in ("ruff-check", "ruff-format", "check-forbidden-imports"):
        assert f"| {hook} | pass |" in out, out


def test_series_lists_every_staged_diff():
    listed = [
        line
        for line in (LATEST / "series").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    on_disk = sorted(str(p.relative_to(LATEST)) for p in LATEST.glob("*/*.patch"))
    assert sorted(listed) == on_disk
    groups = list(dict.fromkeys(line.split("/")[0] for line in listed))
    assert groups == stage_latest.STAGED  # one block per series, in order
    readme = (LATEST / "README.md").read_text()
    assert stage_latest.LATEST_VERSION in readme


# -- the rewritten kv_tables on views shaped as the newest vLLM makes them ------
def _new_file(diff: pathlib.Path) -> str:
    lines = diff.read_text().splitlines(keepends=True)[3:]
    return "".join(line[1:] for line in lines)


def _load(name: str, diff: str, monkeypatch) -> types.ModuleType:
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look it up
    exec(compile(_new_file(LATEST / diff), diff, "exec"), module.__dict__)
    return module


@pytest.fixture
def kv_tables(monkeypatch):
    block_copy = _load(
        "vllm.v1.kv_offload.block_copy",
        "shared-pool/0001-v1-kv_offload-block_copy.patch",
        monkeypatch,
    )
    tables = _load(
        "vllm.v1.kv_offload.kv_tables",
        "shared-pool/0003-v1-kv_offload-kv_tables.patch",
        monkeypatch,
    )
    return block_copy, tables


L, B, H, N, C = 3, 5, 2, 4, 8  # layers, blocks, heads, tokens, fp16 per cell
ES = 2
PAGE = H * N * C * ES


def _views(order: str, pad: int = 0, kernel_split: int = 1):
    """Per-layer [B, H, N, C] fp16 views of one int8 buffer, as the newest
    vLLM's allocate_kv_cache makes them (RFC #42082): block b of layer l at
    l * layer_stride + b * block_stride."""
    if order == "BLHNC":  # block-outermost: all layers' pages per block
        layer_stride, block_stride = PAGE, L * PAGE + pad
        inner = (N * C, C, 1)
    else:  # LBNHC: layer-outermost, tokens before heads in a page
        layer_stride, block_stride = B * PAGE, PAGE
        inner = (C, H * C, 1)
    buf = torch.arange(L * B * PAGE + B * pad, dtype=torch.int32).to(torch.int8)
    fp16 = buf.view(torch.float16)
    shape = (B * kernel_split, H, N // kernel_split, C)
    stride = (block_stride // ES // kernel_split, *inner)
    views = {
        f"layer.{i}": fp16.as_strided(shape, stride, i * layer_stride // ES)
        for i in range(L)
    }
    views["shared"] = views["layer.1"]  # a KV-sharing layer aliases layer 1
    return buf, views


CONFIG = types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks=B))


def test_block_outermost_views_are_one_run_per_block(kv_tables):
    block_copy, tables = kv_tables
    buf, views = _views("BLHNC")
    per_layer = tables.per_layer_table(CONFIG, views)
    assert per_layer.runs_per_block == L  # the alias is not moved twice
    cross = tables.cross_layer_table(per_layer)
    assert cross is not None and cross.runs_per_block == 1
    assert cross.block_bytes == L * PAGE
    ids = torch.tensor([3, 0, 4], dtype=torch.int64)
    packed = torch.empty(3, L * PAGE, dtype=torch.uint8)
    block_copy.gather(cross, ids, packed, "reference")
    raw = buf.view(torch.uint8)
    for row, b in enumerate(ids.tolist()):  # the block's bytes verbatim
        assert torch.equal(packed[row], raw[b * L * PAGE : (b + 1) * L * PAGE])
    via_layers = torch.empty_like(packed)
    block_copy.gather(per_layer, ids, via_layers, "dma")
    assert torch.equal(via_layers, packed)


def test_other_layouts_keep_the_per_layer_path(kv_tables):
    block_copy, tables = kv_tables
    _, views = _views("LBNHC")
    per_layer = tables.per_layer_table(CONFIG, views)
    assert per_layer.runs_per_block == L
    assert tables.cross_layer_table(per_layer) is None
    _, padded = _views("BLHNC", pad=64)  # padding between packed blocks
    assert tables.cross_layer_table(tables.per_layer_table(CONFIG, padded)) is None


def test_kernel_blocks_are_grouped_into_cache_blocks(kv_tables):
    block_copy, tables = kv_tables
    buf, views = _views("LBNHC", kernel_split=2)
    table = tables.per_layer_table(CONFIG, views)
    assert table.num_blocks == B and table.block_bytes == L * PAGE
    packed = torch.empty(1, L * PAGE, dtype=torch.uint8)
    block_copy.gather(table, torch.tensor([2]), packed, "reference")
    raw = buf.view(torch.uint8)
    for layer in range(L):
        start = layer * B * PAGE + 2 * PAGE
        got = packed[0, layer * PAGE : (layer + 1) * PAGE]
        assert torch.equal(got, raw[start : start + PAGE])
    with pytest.raises(ValueError, match="not a multiple"):
        tables.per_layer_table(
            types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks=3)),
            views,
        )


# -- the static import check ---------------------------------------------------
def test_import_check_finds_missing_modules_and_names(tmp_path):
    (tmp_path / "vllm" / "a").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "a" / "__init__.py").write_text("from .b import *\n")
    (tmp_path / "vllm" / "a" / "b.py").write_text(
        "import torch as _t\nif _t:\n    def f(): ...\nelse:\n    g = 1\n"
    )
    (tmp_path / "vllm" / "a" / "sub.py").write_text("X = 1\n")
    staged = {
        "vllm/c/__init__.py": "",
        "vllm/c/d.py": (
            "from vllm.a import f, g, sub\n"
            "from vllm.a import missing\n"
            "from .e import y\n"
            "import vllm.nope\n"
            "def h():\n    from vllm.a.b import _t, z\n"
        ),
        "vllm/c/e.py": "y = 2\n",
    }
    tree = stage_latest.Tree(tmp_path, staged)
    problems = stage_latest.unresolved(tree, "vllm/c/d.py")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "vllm.a import missing: vllm/a/__init__.py does not define missing",
        "vllm.nope: no module vllm.nope",
        "vllm.a.b import z: vllm/a/b.py does not define z",
    ]
