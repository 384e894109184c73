"""Stage two series of patches/ against the newest vLLM release: patches/latest.

    python patches/tools/fetch_sdist.py --latest     # once (network): the sdist
    python patches/tools/stage_latest.py             # (re)write patches/latest
    python patches/tools/stage_latest.py --check     # exit 1 if patches/latest is stale
    python patches/tools/stage_latest.py --verify    # --check + apply, hooks, compile
    python patches/tools/check_upstream.py --version 0.33.0 \\
        --series patches/latest/series               # vLLM's hooks of that release

One source of truth: the staged series are made from the 0.11.2 series in
``patches/`` (``patches/series``), never edited by hand.

* ``pp-kv-budget`` and ``shared-pool`` (``STAGED``) exist in no vLLM release.
  Each of their 0.11.2 diffs is staged in the same order: a diff that adds a
  file is the same file (its text read from the 0.11.2 diff, which
  ``patches/generate.py --check`` keeps equal to the runtime), adapted by
  ``REWRITES``; a diff that edits an upstream file is re-made on the newest
  release's file by ``EDITS`` (insertions at anchors that must occur exactly
  once there).
* What a staged new file imports from a ``vllm`` module that the newest
  release does not have, but a new file of another 0.11.2 series adds (the
  shared pool's helpers from the ``offloading`` series), is staged first in
  the same series, transitively (``prerequisites``).
* New files are then fixed and formatted by the ruff version the newest
  release's pre-commit config pins, with that release's ``pyproject.toml``.
* ``check_imports``: every ``from vllm... import X`` (and ``import vllm...``)
  of a staged new file, and of the lines an edit adds, must resolve in the
  newest sdist plus the staged files: the module file exists and binds ``X``
  (a definition, an assignment, an import, a star import of a module that
  does, or a submodule).  Generation fails otherwise.

``patches/latest/REWRITES.md`` (written too) lists every rewrite and edit
with its reason; ``patches/latest/README.md`` is written by hand.
``--check`` regenerates into a temporary folder and compares byte for byte.
``--verify`` then applies the staged series in order to the same clean tree
of the sdist (staging only reads it), each diff first with ``git apply
--check`` and ``patch --dry-run -p1 -F0`` (no fuzz; an offset is a failure
too), runs that release's offline pre-commit hooks on it exactly as
``check_upstream.py --series patches/latest/series`` does (one extraction
instead of two) and compiles every file the series touch (``python -m
py_compile``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import filecmp
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

TOOLS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS.parent))
import check_upstream  # noqa: E402
import fetch_sdist  # noqa: E402
import generate  # noqa: E402  (patches/generate.py: diff formats, registrations)

ROOT = TOOLS.parents[1]
PATCHES = ROOT / "patches"
OUT = PATCHES / "latest"
LATEST_VERSION = "0.33.0"  # the release the rewrites and edits are made for
STAGED = ["shared-pool", "pp-kv-budget"]  # in patches/series order
HAND_WRITTEN = {"README.md"}  # in patches/latest, not generated (nor mbox/)

_KV = "vllm/distributed/kv_transfer/kv_connector/v1"


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """In the new file PATH: OLD (exactly once) becomes NEW, because WHY."""

    path: str
    old: str
    new: str
    why: str


@dataclasses.dataclass(frozen=True)
class Edit:
    """In the newest release's PATH: TEXT inserted after (``where="after"``)
    or before the ANCHOR (exactly once there), or appended (``"end"``)."""

    path: str
    anchor: str
    text: str
    why: str
    where: str = "after"


# -- rewrites of the 0.11.2 new files ---------------------------------------
REWRITES = [
    # kv_tables.py (offloading series): no cross-layer series to lean on
    Rewrite(
        "vllm/v1/kv_offload/kv_tables.py",
        "from vllm.v1.kv_offload.block_copy import BlockTable\n",
        "from vllm.v1.kv_offload.block_copy import BlockTable, Segment\n",
        "cross_layer_table (below) builds one Segment per block",
    ),
    Rewrite(
        "vllm/v1/kv_offload/kv_tables.py",
        """\
def cross_layer_table(kv_cache: torch.Tensor, layout) -> BlockTable:
    return BlockTable.from_tensors([kv_cache], 0).coarsen(layout.blocks_per_cache_block)
""",
        '''\
def cross_layer_table(table: BlockTable) -> BlockTable | None:
    """TABLE as one run per block when its runs tile each block back to back
    (the per-layer views of a block-outermost KV cache layout, e.g. BLHNC:
    cross-layer blocks); None otherwise."""
    runs = sorted(table.segments, key=lambda seg: seg.offset)
    first = runs[0]
    for prev, seg in zip(runs, runs[1:]):
        if (
            seg.storage.data_ptr() != first.storage.data_ptr()
            or seg.stride != first.stride
            or seg.offset != prev.offset + prev.length
        ):
            return None
    if first.stride != table.block_bytes:  # padding or other groups between
        return None
    whole = Segment(first.storage, first.offset, first.stride, table.block_bytes)
    return BlockTable((whole,), table.num_blocks, table.device)
''',
        "the newest vLLM has no cross-layer buffer with a layout object (our "
        "cross-layer series): cross-layer blocks are the block-outermost KV "
        "cache layouts (vllm.v1.kv_cache_layout.KVCacheLayout, e.g. BLHNC), "
        "whose per-layer views put every layer's page of a block back to "
        "back; the cross-layer table is recognised from the per-layer one",
    ),
    Rewrite(
        "vllm/v1/kv_offload/kv_tables.py",
        """\
def per_layer_table(vllm_config, kv_caches: dict[str, torch.Tensor]) -> BlockTable:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker.cross_layer_kv import name_kv_cache_dims

    layers = get_layers_from_vllm_config(
        vllm_config, AttentionLayerBase, list(kv_caches)
    )
    tensors, seen, blocks_dims, kernel_sizes = [], set(), set(), set()
    for name, tensor in kv_caches.items():
        key = (tensor.data_ptr(), tuple(tensor.stride()))
        if key in seen:  # KV-sharing layers alias one tensor
            continue
        seen.add(key)
        dims = name_kv_cache_dims(
            layers[name].get_attn_backend(), 97, 16, 2, 64, "auto"
        )
        blocks_dims.add(dims.index("blocks"))
        kernel_sizes.add(tensor.shape[dims.index("tokens")])
        tensors.append(tensor)
    if len(blocks_dims) != 1 or len(kernel_sizes) != 1:
        raise ValueError(
            "per-layer KV caches differ in layout; cannot move "
            "them with one block table"
        )
    table = BlockTable.from_tensors(tensors, blocks_dims.pop())
    return table.coarsen(vllm_config.cache_config.block_size // kernel_sizes.pop())
""",
        """\
def per_layer_table(vllm_config, kv_caches: dict[str, torch.Tensor]) -> BlockTable:
    # Every layer's view is [blocks, heads, tokens, content] (RFC #42082),
    # in kernel blocks where the attention kernel splits a cache block.
    tensors, seen = [], set()
    for tensor in kv_caches.values():
        key = (tensor.data_ptr(), tuple(tensor.stride()))
        if key in seen:  # KV-sharing layers alias one tensor
            continue
        seen.add(key)
        tensors.append(tensor)
    table = BlockTable.from_tensors(tensors, 0)
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    if not num_blocks or table.num_blocks % num_blocks:
        raise ValueError(
            f"{table.num_blocks} kernel blocks per layer are not a multiple "
            f"of the {num_blocks} KV cache blocks"
        )
    return table.coarsen(table.num_blocks // num_blocks)
""",
        "the newest vLLM views every layer's KV cache as [B, H, N, C] with "
        "blocks first (RFC #42082), so the blocks dimension needs no probing "
        "of the backend's shape (name_kv_cache_dims, cross-layer series); "
        "kernel blocks per cache block = the view's blocks / "
        "cache_config.num_gpu_blocks (set from the KV cache config before "
        "the connector is made)",
    ),
    # shared_pool_connector/common.py
    Rewrite(
        f"{_KV}/shared_pool_connector/common.py",
        """\
    from vllm.attention.selector import get_attn_backend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout
""",
        """\
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend
""",
        "get_attn_backend moved to vllm.v1.attention.selector; "
        "get_kv_cache_layout is gone (the layout is resolved once, into "
        "CacheConfig.kv_cache_layout); get_attn_backend reads the current "
        "vLLM config",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/common.py",
        """\
    backend = get_attn_backend(
        model.get_head_size(),
        model.dtype,
        cache.cache_dtype,
        cache.block_size,
        use_mla=model.use_mla,
    )
""",
        """\
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            model.get_head_size(),
            model.dtype,
            cache.cache_dtype,
            use_mla=model.use_mla,
        )
""",
        "get_attn_backend has no block_size parameter (it takes the block "
        "size from the current config, which it asserts is set): the 4th "
        "positional argument is now use_mla",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/common.py",
        """\
    try:
        order = tuple(
            backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
        )
    except (AttributeError, NotImplementedError, TypeError):
        order = None
    cross = "on" if cross_layer_expected() and order is not None else "off"
    return (
        f"{backend.get_name()}/{get_kv_cache_layout()}/layers-order={order}"
        f"/cross-layer={cross}"
    )
""",
        """\
    layout = cache.get_resolved_kv_cache_layout()
    cross = "on" if cross_layer_expected() and layout.is_block_outermost else "off"
    return f"{backend.get_name()}/{layout.name}/cross-layer={cross}"
""",
        "no stride order with a layers dimension any more: the KV cache "
        "layout (KVCacheLayout, resolved before either role makes its "
        "connector) names the byte order, and a block-outermost one means "
        "cross-layer blocks",
    ),
    # shared_pool_connector/scheduler.py
    Rewrite(
        f"{_KV}/shared_pool_connector/scheduler.py",
        '("ask again next step": vLLM 0.11.2 leaves the request waiting',
        '("ask again next step": vLLM leaves the request waiting',
        "the docstring named the release the code was written for",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/scheduler.py",
        """\
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            yield_req_data,
        )
""",
        """\
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
""",
        "yield_req_data moved to kv_connector/utils.py",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/scheduler.py",
        """\
        for req_id, new_ids, preempted in yield_req_data(scheduler_output):
            if req_id not in self._requests:
                continue
            ids = self._block_ids.setdefault(req_id, [])
            if preempted:
""",
        """\
        for req_id, new_ids, full_table in yield_req_data(scheduler_output):
            if req_id not in self._requests:
                continue
            ids = self._block_ids.setdefault(req_id, [])
            if full_table:
""",
        "yield_req_data's third field is now is_full_table (True for new "
        "requests too, not only resumed ones): the ids are then the whole "
        "block table, so the copy is replaced either way",
    ),
    # shared_pool_connector/worker.py
    Rewrite(
        f"{_KV}/shared_pool_connector/worker.py",
        """\
    def register_cross_layers_kv_cache(self, kv_cache, layout) -> None:
        table = cross_layer_table(kv_cache, layout)
        self._set_table(
            table,
            f"cross-layer buffer ({layout.num_layers} layers)",
            table_layout_tag(
                "cross-layer",
                table,
                f"dims={layout.dims}|dtype={layout.dtype}|layers="
                f"{layout.num_layers}|kernel-block={layout.kernel_block_size}",
            ),
        )

""",
        "",
        "the newest vLLM has no register_cross_layers_kv_cache hook: "
        "cross-layer blocks arrive through register_kv_caches (below)",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/worker.py",
        """\
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        table = per_layer_table(self.vllm_config, kv_caches)
        first = next(iter(kv_caches.values()))
""",
        """\
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        table = per_layer_table(self.vllm_config, kv_caches)
        first = next(iter(kv_caches.values()))
        cross = cross_layer_table(table) if layout.is_block_outermost else None
        if cross is not None:
            self._set_table(
                cross,
                f"cross-layer blocks ({table.runs_per_block} layers, {layout.name})",
                table_layout_tag(
                    "cross-layer",
                    cross,
                    f"kv-layout={layout.name}|dtype={first.dtype}|"
                    f"layers={table.runs_per_block}",
                ),
            )
            return
""",
        "cross-layer blocks on the newest vLLM: with a block-outermost "
        "layout (the connector asks for BLHNC) the per-layer views tile each "
        "block, and one run per block is moved (the value is the block's "
        "bytes verbatim, as with our cross-layer buffer); any other layout "
        "keeps the per-layer path",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/worker.py",
        'f"kv-layout={get_kv_cache_layout()}|dtype={first.dtype}|"',
        'f"kv-layout={layout.name}|dtype={first.dtype}|"',
        "get_kv_cache_layout is gone: the resolved KVCacheLayout's name",
    ),
    # shared_pool_connector/__init__.py
    Rewrite(
        f"{_KV}/shared_pool_connector/__init__.py",
        """\
    prefer_cross_layer_blocks = True
""",
        """\
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # Cross-layer blocks: every layer's page of a block back to back, so
        # a pool value is the block's bytes verbatim.  Where an attention
        # backend cannot use this layout vLLM picks another one (a warning)
        # and the worker moves per-layer runs.
        return "BLHNC"

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store lost to a preemption is a later miss.
        return False
""",
        "prefer_cross_layer_blocks (our cross-layer series) is replaced by "
        "upstream's way for a connector to ask for a KV cache layout; "
        "requires_kv_delivery defaults to is_kv_producer on the newest vLLM, "
        "which would recompute a preempted request whose stores are pending",
    ),
    Rewrite(
        f"{_KV}/shared_pool_connector/__init__.py",
        """\
    def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_cross_layers_kv_cache(kv_cache, layout)

""",
        "",
        "no register_cross_layers_kv_cache hook on the newest vLLM",
    ),
]

# -- edits re-made on the newest release's files -----------------------------
_BUDGET_IMPORT = "from vllm.v1.worker.pp_kv_budget import rank_kv_cache_budget\n"
EDITS = {
    "vllm/config/cache.py": [
        Edit(
            "vllm/config/cache.py",
            '    (when not-None) ignores gpu_memory_utilization"""\n',
            '''
    enable_pp_prop_kv_cache: bool = False
    """With pipeline parallelism, treat kv_cache_memory_bytes as the KV cache
    budget of the whole pipeline and give each stage a share proportional to
    its number of layers, so that every stage fits the same number of blocks.
    Requires kv_cache_memory_bytes."""
''',
            "the field, after kv_cache_memory_bytes (as on 0.11.2)",
        ),
        Edit(
            "vllm/config/cache.py",
            '            "kv_cache_memory_bytes",\n',
            '            "enable_pp_prop_kv_cache",\n',
            "new on the newest vLLM: CacheConfig.compute_hash hashes every "
            "field not in ignored_factors (0.11.2 hashed a fixed list); the "
            "flag changes the KV budget, not the compiled graph, like "
            "kv_cache_memory_bytes",
        ),
    ],
    "vllm/engine/arg_utils.py": [
        Edit(
            "vllm/engine/arg_utils.py",
            "    kv_cache_memory_bytes: int | None = "
            "CacheConfig.kv_cache_memory_bytes\n",
            "    enable_pp_prop_kv_cache: bool = CacheConfig.enable_pp_prop_kv_cache\n",
            "the EngineArgs field",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            """\
        cache_group.add_argument(
            "--kv-cache-memory-bytes", **cache_kwargs["kv_cache_memory_bytes"]
        )
""",
            """\
        cache_group.add_argument(
            "--enable-pp-prop-kv-cache", **cache_kwargs["enable_pp_prop_kv_cache"]
        )
""",
            "the CLI flag, after --kv-cache-memory-bytes",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            "            kv_cache_memory_bytes=self.kv_cache_memory_bytes,\n",
            "            enable_pp_prop_kv_cache=self.enable_pp_prop_kv_cache,\n",
            "passed to CacheConfig",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            "            shutdown_timeout=self.shutdown_timeout,\n        )\n",
            """
        from vllm.v1.worker.pp_kv_budget import validate_pp_kv_budget

        validate_pp_kv_budget(config)
""",
            "checked at the end of create_engine_config, before any worker "
            "starts (VllmConfig(...) now ends with shutdown_timeout)",
        ),
    ],
    "vllm/v1/worker/gpu_worker.py": [
        Edit(
            "vllm/v1/worker/gpu_worker.py",
            "        if kv_cache_memory_bytes := "
            "self.cache_config.kv_cache_memory_bytes:\n",
            f"""\
            {_BUDGET_IMPORT}
            kv_cache_memory_bytes = rank_kv_cache_budget(
                self.vllm_config, kv_cache_memory_bytes
            )
""",
            "determine_available_memory: this stage's share of the budget "
            "(the branch now returns reserve_mm_ipc_gpu_memory(...) of it)",
        ),
    ],
    "vllm/v1/worker/cpu_worker.py": [
        Edit(
            "vllm/v1/worker/cpu_worker.py",
            "        if explicit_kv_cache_size is not None:\n",
            f"""\
            {_BUDGET_IMPORT}
            explicit_kv_cache_size = rank_kv_cache_budget(
                self.vllm_config, explicit_kv_cache_size
            )
""",
            "the CPU worker honours kv_cache_memory_bytes itself now (0.11.2's "
            "edit added that); only this stage's share is left to take",
        ),
    ],
    generate.FACTORY: [
        Edit(
            generate.FACTORY,
            "",
            generate.POOL_REGISTRATION,
            "the registration (generate.POOL_REGISTRATION) at the end of the "
            "file: the offloading connector's registration it followed on "
            "0.11.2 is not staged",
            where="end",
        ),
    ],
}


# -- the 0.11.2 series -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    """One diff of patches/series."""

    name: str  # e.g. "shared-pool/0009-kv_connector-v1-shared_pool-pool.patch"
    path: str  # the upstream file it adds or edits
    new: bool
    text: str  # the whole file, for a new one

    @property
    def series(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def module(self) -> str:
        return _module_of(self.path)


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def read_sources() -> list[Source]:
    """The 0.11.2 series' diffs, without their upstream tests (written for
    0.11.2's APIs and run there by run_upstream_tests.py; not staged)."""
    sources = []
    for name in check_upstream.series_names():
        if "-tests-v1-" in name:
            continue
        diff = (PATCHES / name).read_text()
        old, new = re.findall(r"^(?:---|\+\+\+) (\S+)", diff, flags=re.M)[:2]
        if old != "/dev/null":
            sources.append(Source(name, old.removeprefix("a/"), False, ""))
            continue
        header = re.match(r"--- /dev/null\n\+\+\+ b/\S+\n@@ -0,0 \+1,(\d+) @@\n", diff)
        if header is None:
            raise SystemExit(f"patches/{name}: not a single new-file diff")
        lines = diff[header.end() :].splitlines(keepends=True)
        if len(lines) != int(header.group(1)) or any(
            not line.startswith("+") for line in lines
        ):
            raise SystemExit(f"patches/{name}: not a single new-file diff")
        text = "".join(line[1:] for line in lines)
        sources.append(Source(name, new.removeprefix("b/"), True, text))
    return sources


# -- the newest sdist ----------------------------------------------------------
class Tree:
    """The newest sdist's files, with the staged new files over them."""

    def __init__(self, root: pathlib.Path, staged: dict[str, str]) -> None:
        self.root = root
        self.staged = staged

    def text(self, path: str) -> str | None:
        if path in self.staged:
            return self.staged[path]
        file = self.root / path
        return file.read_text() if file.is_file() else None

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if self.text(path) is not None:
                return path
        return None


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _absolute(module: str | None, level: int, path: str) -> str:
    if not level:
        return module or ""
    package = _module_of(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def bound_names(tree: Tree, path: str, seen: set[str] | None = None) -> set[str]:
    """Names the module file PATH binds at its top level (if/try included),
    through star imports too; the ``__all__`` of a module with ``__getattr__``."""
    seen = seen if seen is not None else set()
    if path in seen:
        return set()
    seen.add(path)
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(_names(target))
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                names.update(_names(node.target))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name != "*":
                        names.add(alias.asname or alias.name)
                        continue
                    module = _absolute(node.module, node.level, path)
                    star = tree.module_path(module)
                    if star is not None:
                        names.update(exported(tree, star, seen))
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    module = ast.parse(tree.text(path) or "")
    visit(module.body)
    if "__getattr__" in names:
        names |= _dunder_all(module) or set()
    return names


def _dunder_all(module: ast.Module) -> set[str] | None:
    for node in module.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            return {
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    return None


def exported(tree: Tree, path: str, seen: set[str]) -> set[str]:
    """What ``from <module> import *`` takes from the module file PATH."""
    declared = _dunder_all(ast.parse(tree.text(path) or ""))
    if declared is not None:
        return declared
    return {n for n in bound_names(tree, path, seen) if not n.startswith("_")}


def vllm_imports(text: str, path: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every vllm import in TEXT."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, path)
            if module == "vllm" or module.startswith("vllm."):
                found += [(node.lineno, module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name, None)
                for a in node.names
                if a.name == "vllm" or a.name.startswith("vllm.")
            ]
    return found


def unresolved(tree: Tree, path: str, lines: set[int] | None = None) -> list[str]:
    """The vllm imports of PATH (on LINES only, if given) that do not
    resolve statically in TREE."""
    problems = []
    for line, module, name in vllm_imports(tree.text(path) or "", path):
        if lines is not None and line not in lines:
            continue
        where = f"{path}:{line}: {module}" + (f" import {name}" if name else "")
        module_path = tree.module_path(module)
        if module_path is None:
            problems.append(f"{where}: no module {module}")
        elif name is None or name == "*":
            continue
        elif name not in bound_names(tree, module_path) and (
            tree.module_path(f"{module}.{name}") is None
        ):
            problems.append(f"{where}: {module_path} does not define {name}")
    return problems


# -- staging -----------------------------------------------------------------
def rewrite(text: str, path: str) -> str:
    for r in REWRITES:
        if r.path != path:
            continue
        if text.count(r.old) != 1:
            raise SystemExit(
                f"rewrite for {path} ({r.why[:60]}...): its text occurs "
                f"{text.count(r.old)} times in the 0.11.2 file, not once"
            )
        text = text.replace(r.old, r.new)
    return text


def edit(text: str, path: str) -> str:
    edits = EDITS.get(path)
    if not edits:
        raise SystemExit(f"no re-made edit for {path} (add one to EDITS)")
    for e in edits:
        if e.where == "end":
            text += e.text
            continue
        if text.count(e.anchor) != 1:
            raise SystemExit(
                f"edit of {path}: its anchor occurs {text.count(e.anchor)} "
                f"times in the newest file, not once: {e.anchor!r}"
            )
        at = text.index(e.anchor) + (len(e.anchor) if e.where == "after" else 0)
        text = text[:at] + e.text + text[at:]
    return text


class Ruff:
    """The pinned ruff of the newest release, with its pyproject.toml."""

    def __init__(self, root: pathlib.Path, install: bool) -> None:
        config = yaml.safe_load((root / ".pre-commit-config.yaml").read_text())
        version = check_upstream._pinned(config, "ruff-pre-commit")
        if version is None:
            raise SystemExit("the newest pre-commit config pins no ruff")
        self.exe, where = check_upstream.tool("ruff", version, install)
        if self.exe is None:
            raise SystemExit(where)
        self.version = version
        self.root = root

    def __call__(self, text: str, path: str) -> str:
        config = str(self.root / "pyproject.toml")
        for args in (["check", "--fix-only", "--quiet"], ["format"]):
            done = subprocess.run(
                [self.exe, *args, "--no-cache", "--config", config]
                # The staged modules are not in the clean tree, and ruff's
                # isort would class what it cannot find as third-party.
                + ["--config", "lint.isort.known-first-party = ['vllm']"]
                + ["--stdin-filename", path, "-"],
                input=text,
                capture_output=True,
                text=True,
                cwd=self.root,
                check=False,
            )
            if done.returncode:
                raise SystemExit(f"ruff {args[0]} {path}: {done.stderr.strip()}")
            text = done.stdout
        return text


@dataclasses.dataclass
class Staged:
    name: str  # "<series>/NNNN-....patch"
    source: Source
    path: str
    text: str  # the new file, or the edited upstream file
    diff: str
    rewrites: list[Rewrite]
    edits: list[Edit]
    prerequisite: bool = False


def prerequisites(
    sources: list[Source], own: list[Source], root: pathlib.Path
) -> list[Source]:
    """New files of other 0.11.2 series that the new files OWN import
    (transitively) from modules the newest release lacks, in series order."""
    providers = {s.module: s for s in sources if s.new}
    wanted: dict[str, Source] = {}
    todo = [s for s in own if s.new]
    while todo:
        source = todo.pop()
        text = rewrite(source.text, source.path)
        for _, module, name in vllm_imports(text, source.path):
            for candidate in (f"{module}.{name}", module):
                provider = providers.get(candidate)
                if (
                    provider is not None
                    and provider not in own
                    and provider.name not in wanted
                    and not root.joinpath(provider.path).exists()
                ):
                    wanted[provider.name] = provider
                    todo.append(provider)
    order = [s.name for s in sources]
    return sorted(wanted.values(), key=lambda s: order.index(s.name))


def stage(root: pathlib.Path, install: bool) -> tuple[list[Staged], Ruff]:
    sources = read_sources()
    ruff = Ruff(root, install)
    staged: list[Staged] = []
    for series in STAGED:
        own = [s for s in sources if s.series == series]
        if not own:
            raise SystemExit(f"patches/series has no {series} diffs")
        before = prerequisites(sources, own, root)
        for number, source in enumerate(before + own, start=1):
            stem = source.name.split("/", 1)[1].split("-", 1)[1]
            name = f"{series}/{number:04d}-{stem}"
            if source.new:
                if root.joinpath(source.path).exists():
                    raise SystemExit(f"{source.path} exists in the newest release")
                text = ruff(rewrite(source.text, source.path), source.path)
                diff = generate._new_file(text, source.path)
                used = [r for r in REWRITES if r.path == source.path]
                staged.append(
                    Staged(
                        name,
                        source,
                        source.path,
                        text,
                        diff,
                        used,
                        [],
                        source in before,
                    )
                )
            else:
                old = (root / source.path).read_text()
                text = edit(old, source.path)
                diff = generate._diff(old, text, source.path)
                staged.append(
                    Staged(
                        name, source, source.path, text, diff, [], EDITS[source.path]
                    )
                )
    unused = [r for r in REWRITES if r.path not in {s.path for s in staged}]
    if unused:
        raise SystemExit(f"rewrites of files not staged: {unused[0].path}")
    check_imports(root, staged)
    return staged, ruff


def check_imports(root: pathlib.Path, staged: list[Staged]) -> None:
    tree = Tree(root, {s.path: s.text for s in staged if s.source.new})
    problems = []
    for s in staged:
        if s.source.new:
            problems += unresolved(tree, s.path)
        else:
            added = _added_lines(s.diff)
            edited = Tree(root, {**tree.staged, s.path: s.text})
            problems += unresolved(edited, s.path, added)
    if problems:
        raise SystemExit(
            "imports that do not resolve in the newest release:\n  "
            + "\n  ".join(problems)
        )


def _added_lines(diff: str) -> set[int]:
    lines, number = set(), 0
    for line in diff.splitlines():
        hunk = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", line)
        if hunk:
            number = int(hunk.group(1))
        elif line.startswith("+") and not line.startswith("+++"):
            lines.add(number)
            number += 1
        elif not line.startswith("-"):
            number += 1
    return lines


def render(staged: list[Staged], version: str, ruff: Ruff) -> dict[str, str]:
    """patches/latest's generated files (relative path -> text)."""
    out = {s.name: s.diff for s in staged}
    header = (
        f"# vLLM {version}: written by patches/tools/stage_latest.py from "
        "patches/series (0.11.2)\n"
    )
    out["series"] = header + "".join(f"{s.name}\n" for s in staged)
    out["REWRITES.md"] = render_rewrites(staged, version, ruff)
    return out


def _snippet_diff(old: str, new: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), n=1
    )
    return "".join(line for line in list(lines)[2:])


def render_rewrites(staged: list[Staged], version: str, ruff: Ruff) -> str:
    out = [
        f"# patches/latest: what the staging for vLLM {version} changed",
        "",
        "Generated by `patches/tools/stage_latest.py` (do not edit): every",
        "diff of `series`, where it comes from, and each rewrite of a 0.11.2",
        "new file and each edit re-made on the newest release's file, with",
        f"its reason.  New files are then fixed and formatted by ruff {ruff.version}",
        f"(vLLM {version}'s pin) with vLLM {version}'s `pyproject.toml`.",
        "",
        "| staged diff | from (patches/) | change |",
        "|---|---|---|",
    ]
    for s in staged:
        if s.source.new:
            what = f"{len(s.rewrites)} rewrite(s)" if s.rewrites else "verbatim"
            if s.prerequisite:
                what += " (prerequisite: imported by the series)"
        else:
            what = f"re-made on vLLM {version}'s file: {len(s.edits)} edit(s)"
        out.append(f"| {s.name} | {s.source.name} | {what} |")
    for s in staged:
        if not (s.rewrites or s.edits):
            continue
        out += ["", f"## {s.name}", "", f"`{s.path}`"]
        for r in s.rewrites:
            out += [
                "",
                f"* {r.why}.",
                "",
                "```diff",
                _snippet_diff(r.old, r.new) + "```",
            ]
        for e in s.edits:
            where = (
                "at the end" if e.where == "end" else f"{e.where} `{e.anchor.strip()}`"
            )
            out += ["", f"* {e.why} ({where}).", "", "```diff"]
            out.append("".join("+" + line for line in e.text.splitlines(True)) + "```")
    return "\n".join(out) + "\n"


def write(files: dict[str, str], folder: pathlib.Path) -> None:
    for name, text in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def compare(folder: pathlib.Path) -> list[str]:
    """Paths of patches/latest that differ from FOLDER's (missing, extra)."""
    stale = []
    made = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
    have = {
        p.relative_to(OUT)
        for p in OUT.rglob("*")
        if p.is_file()
        and p.name not in HAND_WRITTEN
        and p.relative_to(OUT).parts[0] != "mbox"  # build_mbox.py's
    }
    for rel in sorted(made | have):
        if rel not in made:
            stale.append(f"{rel} (not generated)")
        elif rel not in have or not filecmp.cmp(folder / rel, OUT / rel, shallow=False):
            stale.append(str(rel))
    return stale


def verify(
    root: pathlib.Path, series: pathlib.Path, version: str, install: bool
) -> list[str]:
    """Apply SERIES to ROOT, a clean tree of the sdist (committed to a
    scratch git repository first): each diff ``git apply --check``, ``patch
    --dry-run -p1 -F0``, then ``git apply --index``.  Then vLLM's offline
    pre-commit hooks of that release (``check_upstream.run_hooks``, the
    table printed) and ``python -m py_compile`` of every file the series
    touch.  Returns the problems."""
    for args in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=stage_latest", "-c", "user.email=stage@localhost"]
        + ["commit", "-qm", f"vllm {version}", "--no-verify"],
    ):
        check_upstream._git(root, *args)
    names = check_upstream.series_names(series)
    for name in names:
        diff = series.parent.resolve() / name
        done = _run(["git", "apply", "--check", str(diff)], root)
        if done.returncode:
            return [f"{name}: git apply --check: {done.stderr.strip()}"]
        done = _run(["patch", "--dry-run", "-p1", "-F0", "-i", str(diff)], root)
        said = done.stdout + done.stderr
        if done.returncode or re.search(r"offset|fuzz|FAILED", said):
            return [f"{name}: patch --dry-run -p1 -F0: {said.strip()}"]
        done = _run(["git", "apply", "--index", str(diff)], root)
        if done.returncode:
            return [f"{name}: git apply --index: {done.stderr.strip()}"]
    print(f"{len(names)} diffs apply (git apply --check; patch -F0: no fuzz/offset)")
    changed = check_upstream._git(
        root, "diff", "--cached", "--name-only", "--diff-filter=AM"
    ).split()
    results = check_upstream.run_hooks(root, install=install)
    label = str(series.resolve().relative_to(ROOT))
    print(check_upstream.render(results, len(changed), len(names), version, label))
    problems = [
        f"{r.hook}: {finding}"
        for r in results
        if r.status == "FAIL"
        for finding in (r.findings or ["failed"])
    ]
    py = [f for f in changed if f.endswith(".py")]
    done = _run([sys.executable, "-m", "py_compile", *py], root)
    if done.returncode:
        problems.append(f"py_compile: {(done.stdout + done.stderr).strip()}")
    else:
        print(f"python -m py_compile: {len(py)} files compile")
    return problems


def _run(cmd: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def scratch() -> str | None:
    """Where to extract the sdist: memory (``/dev/shm``, with 2 GiB free)
    unless ``$TMPDIR`` says otherwise; the 8,500 files of the sdist and their
    git objects are written three to four times faster there."""
    shm = pathlib.Path("/dev/shm")
    if os.environ.get("TMPDIR") or not shm.is_dir() or not os.access(shm, os.W_OK):
        return None
    return str(shm) if shutil.disk_usage(shm).free >= 2 << 30 else None


def sdist_path(version: str, fetch: bool) -> pathlib.Path | None:
    hit = fetch_sdist.cached(version)
    if hit is None and fetch:
        hit = fetch_sdist.fetch(version)
    return hit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=LATEST_VERSION)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if patches/latest is stale"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="--check, then apply patches/latest/series and compile",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="never download the sdist or install the pinned ruff",
    )
    args = parser.parse_args(argv)
    sdist = sdist_path(args.version, fetch=not args.offline)
    if sdist is None:
        print(fetch_sdist.missing(args.version), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vllm-stage-", dir=scratch()) as tmp:
        root = check_upstream.extract(sdist, pathlib.Path(tmp) / "sdist")
        staged, ruff = stage(root, install=not args.offline)
        files = render(staged, args.version, ruff)
        if not (args.check or args.verify):
            for old in OUT.rglob("*.patch"):
                old.unlink()
            write(files, OUT)
            print(f"wrote {len(staged)} diffs to {OUT.relative_to(ROOT)}")
            return 0
        made = pathlib.Path(tmp) / "latest"
        write(files, made)
        stale = compare(made)
        if stale:
            print(
                "stale (run python patches/tools/stage_latest.py):",
                *stale,
                sep="\n  ",
            )
            return 1
        print(f"patches/latest is up to date: {len(staged)} diffs, vLLM {args.version}")
        if args.verify:  # the tree is still the clean sdist: staging reads only
            problems = verify(root, OUT / "series", args.version, not args.offline)
            if problems:
                print("FAILED:", *problems, sep="\n  ")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
