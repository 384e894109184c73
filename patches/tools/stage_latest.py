"""Stage the vLLM 0.32 runtime patches on the newest vLLM release: patches/latest.

    python patches/tools/fetch_sdist.py --version 0.33.0   # once (network)
    python patches/tools/stage_latest.py             # (re)write patches/latest
    python patches/tools/stage_latest.py --check     # exit 1 if patches/latest is stale
    python patches/tools/stage_latest.py --verify    # --check + apply, hooks, compile

One source of truth: the series are rendered from the runtime modules that
run on vLLM 0.32 (``vllm_overlay/patches/v0_32``, its ``MODULES`` in order),
never written by hand.  One series per patch module (``patch_cpu_attn`` ->
``cpu-attn/``):

* first its new files: the overlay modules the patch module imports
  (transitively; ``vllm_overlay.core.patching`` is the runtime's machinery,
  not a dependency), under the upstream module names of ``MODULES``, written
  as ``patches/generate.py`` writes the 0.11.2 series' new files
  (``generate.rewrite``, ``generate.upstream_style``), formatted by the ruff
  the newest release's pre-commit config pins, with its ``pyproject.toml``;
  a new file an earlier series already adds is not added again;
* then one diff per upstream file its patches edit: each ``Patch``'s
  function rendered into the upstream function by ``render_patch`` (the
  convention a patch module follows: its docstring, patches/README.md).

``release_compat.py``'s record says, in ``series``, whether the files each
series touches are vLLM 0.32.0's on the newest release (where the runtime
ran) or which of them moved.  Staging fails where an import of the staged
code does not resolve statically in the newest sdist plus the staged files
(``static_imports``).  ``--check`` regenerates into a temporary folder and
compares byte for byte.  ``--verify`` then applies the staged series in order
to the clean tree of the sdist (``latest_verify``: no fuzz, no offset),
runs that release's offline pre-commit hooks and compiles the touched files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import re
import sys
import tempfile

TOOLS = pathlib.Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS.parent))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import check_upstream  # noqa: E402
import generate  # noqa: E402  (patches/generate.py: names, style, diff formats)
import latest_verify  # noqa: E402
import render_patch  # noqa: E402
import static_imports  # noqa: E402
from render_ast import RUNTIME_ONLY  # noqa: E402

PATCHES = ROOT / "patches"
OUT = PATCHES / "latest"
LATEST_VERSION = "0.33.0"  # the newest release on PyPI (fetch_sdist.py --latest)
PATCH_SET = "v0_32"
HAND_WRITTEN = {"README.md"}  # in patches/latest, not generated (nor mbox/)
RUNTIME = "vllm_overlay.core.patching"  # the patch machinery: never staged
RECORD = ROOT / "vllm_overlay" / "patches" / PATCH_SET / "releases.json"

# overlay module -> upstream module: the 0.11.2 series' names, and the v0_32
# integration modules'
MODULES = {
    **generate.MODULES,
    "vllm_overlay.integration.v0_32.offload_worker": (
        "vllm.v1.kv_offload.cpu.cpu_platform_worker"
    ),
    # the copy step both CPU workers share: next to block_copy (0.32 has no
    # kv_offload/worker package)
    "vllm_overlay.core.offload.host_copy": "vllm.v1.kv_offload.host_copy",
    # the engine's bounded wait while requests only wait for KV loads: the
    # wait (shared with 0.11.2), then 0.32's gate
    "vllm_overlay.core.idle_wait": "vllm.v1.engine.kv_idle_gate",
    "vllm_overlay.integration.v0_32.idle_wait": "vllm.v1.engine.kv_idle_wait",
    # the PP KV budget: the split, the flag (option, validation, per-stage
    # budgets), the engine core's split of the workers' KV memory
    "vllm_overlay.core.pp_budget": "vllm.v1.core.pp_kv_budget",
    "vllm_overlay.integration.pp_kv": "vllm.v1.core.pp_kv_budget_flag",
    "vllm_overlay.integration.v0_32.pp_kv": "vllm.v1.core.pp_kv_budget_split",
    # the KV identity a shared tier namespaces by: the config's part and the
    # engine's (weights fingerprint, in-page layout), measured in the workers
    "vllm_overlay.integration.v0_32.kv_identity": "vllm.v1.kv_offload.kv_identity",
    "vllm_overlay.integration.v0_32.worker_identity": (
        "vllm.v1.kv_offload.worker_kv_identity"
    ),
}
# the overlay's name in messages and thread names -> vLLM's (after
# generate.OVERLAY_NAMES); a name left is an error (check_upstream.IDENTITY)
NAMES = [
    ("vllm-overlay CPU offloading", "CPU offloading"),
    ("vllm-overlay KV identity", "KV offloading identity"),
    ('name="vllm-overlay-offload"', 'name="kv-offload-cpu"'),
    ("vllm-overlay: ", ""),
    ("(vllm-overlay) ", ""),
    ("``core/ops``' DMA path", "the DMA path of ``block_copy``"),
    ("on ``core/ops``", "on ``block_copy``"),
    ("by core/ops dma", "by block_copy's dma path"),
]


# One commit per series (build_mbox.py): subject and body in vLLM's PR
# style; a series not listed here gets its text from its patch module
# (``commits``).
COMMIT_TEXT: dict[str, tuple[str, str]] = {
    "cpu-attn": (
        "[CPU][Attention] CPU_ATTN: offer the BLHNC (cross-layer) KV cache layout",
        "CPU_ATTN lists only LBHNC in supported_kv_cache_layouts, so a KV\n"
        "connector (get_required_kvcache_layout) or VLLM_KV_CACHE_LAYOUT\n"
        "asking for block-outermost cross-layer blocks is refused on the CPU\n"
        "platform. Its kernels (cpu_attn_reshape_and_cache,\n"
        "cpu_attention_with_kv_cache) index each layer's cache through its\n"
        "block stride, and K and V are split by a view of the contiguous\n"
        "[heads, tokens, 2*head_size] run, so BLHNC works as is. Offering it\n"
        "after LBHNC keeps the default layout.",
    ),
    "cpu-offload-spec": (
        "[KVConnector][CPU] OffloadingConnector on the CPU platform",
        "CPUOffloadingSpec.get_worker refuses every platform but CUDA-alike\n"
        "and XPU, and its worker runs on CUDA streams. On the CPU platform it\n"
        "now returns a worker that moves blocks between the KV cache and one\n"
        "host buffer with block_copy's DMA path (one copy per block with a\n"
        "block-outermost layout such as BLHNC, consecutive blocks merged) on\n"
        "a background thread; the connector, manager, eviction policies and\n"
        "cpu_bytes_to_use sizing are unchanged. TieringOffloadingSpec is\n"
        "refused on CPU with a clear error (its primary tier is read through\n"
        "a shared region).",
    ),
    "arg-utils": (
        "[Core] --enable-pp-prop-kv-cache: one KV budget for the pipeline",
        "With pipeline parallelism every stage gets the whole\n"
        "--kv-cache-memory-bytes and the engine keeps the smallest stage's\n"
        "block count, so with an uneven layer partition the stage with more\n"
        "layers sets the blocks. --enable-pp-prop-kv-cache (carried in\n"
        'additional_config["enable_pp_prop_kv_cache"], which reaches the\n'
        "engine core; LLM(additional_config=...) sets it too) makes the\n"
        "budget the whole pipeline's, split by layers. create_engine_config\n"
        "rejects a bad configuration before any engine process starts: no\n"
        "budget, a VLLM_PP_LAYER_PARTITION that does not split the model,\n"
        "less than one block on a stage; and it keeps an explicit\n"
        "--kv-cache-memory-bytes as the budget where the CPU platform\n"
        "replaces it with VLLM_CPU_KVCACHE_SPACE. The split itself is the\n"
        "next commit.\n"
        "\n"
        "As proposed in PR #25164.",
    ),
    "engine-core": (
        "[Core] Size each PP stage's KV cache by its share of the budget",
        "With --enable-pp-prop-kv-cache, get_kv_cache_configs sizes each\n"
        "worker with its stage's share of --kv-cache-memory-bytes by layers\n"
        "(less what the worker kept back from the budget), so every stage\n"
        "fits the same number of blocks and none is left unused. A worker's\n"
        "stage comes from the layers in its KV specs. Without the flag\n"
        "nothing changes.\n"
        "\n"
        "As proposed in PR #25164.",
    ),
}


def commits() -> dict[str, list[tuple[str, str, list[str]]]]:
    """series -> its one commit (build_mbox.py): COMMIT_TEXT's, else the
    patch module's summary (its docstring's first line) and the patches'
    ``why``."""
    out = {}
    for module in patch_modules():
        series = series_name(module)
        numbers = sorted(p.name[:4] for p in (OUT / series).glob("*.patch"))
        if series in COMMIT_TEXT:
            subject, body = COMMIT_TEXT[series]
        else:
            summary = (module.__doc__ or series).splitlines()[0]
            subject = "[Core] " + summary.split(": ", 1)[-1].rstrip(".")
            body = "\n\n".join(p.why for p in module.PATCHES)
        if check_upstream.IDENTITY.search(subject + body):
            raise SystemExit(f"{series}: the commit text names the overlay")
        out[series] = [(subject, body, numbers)]
    return out


@dataclasses.dataclass
class Staged:
    name: str  # "<series>/NNNN-....patch"
    path: str  # the upstream file it adds or edits
    origin: str  # the runtime module it comes from
    new: bool
    text: str  # the new file, or the edited upstream file
    diff: str


# Patch modules of the set that are not staged (series name -> why): their
# wrappers are not of the forms render_wrapper.py turns into an edit of
# upstream's function.
NOT_STAGED = {
    "offloading-connector": "wraps build_offloading_config as imported by "
    "offloading_connector.py (the pool tier's model config identity)",
    "rotary-embedding": "wraps RotaryEmbedding.forward_cpu (the fix belongs "
    "in the CPU kernel, csrc/cpu/pos_encoding.cpp)",
    "offloading-worker": "marks a failed store with the count code "
    "offloading-scheduler reads (the two go together)",
    "offloading-scheduler": "wraps update_connector_output, with the "
    "manager's complete_store failing the marked stores for the call",
}

# Patches of a staged module that are not staged (id -> why): not of a form
# render_patch.py turns into an edit.
NOT_STAGED_PATCHES = {
    "OF32-02": "replaces the CPUOffloadingWorker name tiering/spec.py imports "
    "(the worker create_worker builds on CPU); vllm/v1/kv_offload/cpu/spec.py "
    "imports the class too, so it cannot be edited where it is defined",
}


def all_patch_modules() -> list:
    return list(importlib.import_module(f"vllm_overlay.patches.{PATCH_SET}").MODULES)


def patch_modules() -> list:
    """The staged ones (NOT_STAGED left out)."""
    return [m for m in all_patch_modules() if series_name(m) not in NOT_STAGED]


def series_name(module) -> str:
    return module.__name__.rsplit(".", 1)[1].removeprefix("patch_").replace("_", "-")


def series_names() -> list[str]:
    return [series_name(m) for m in patch_modules()]


def depends() -> dict[str, list[str]]:
    """series -> the earlier series that add new files it needs."""
    out, added = {}, {}
    for module in patch_modules():
        series = series_name(module)
        needs = new_modules(module)
        out[series] = sorted({added[m] for m in needs if m in added})
        for m in needs:
            added.setdefault(m, series)
    return out


def _from_package(match: re.Match) -> str:
    """``from PACKAGE import MODULE`` of an overlay module, with its
    upstream package and name (``as`` the overlay's name if it differs)."""
    indent, package, name = match.groups()
    upstream = MODULES.get(f"{package}.{name}")
    if upstream is None:
        return match.group(0)
    parent, _, last = upstream.rpartition(".")
    alias = "" if last == name else f" as {name}"
    return f"{indent}from {parent} import {last}{alias}"


def rename(text: str) -> str:
    """TEXT with the overlay's module, class and message names upstream's."""
    text = generate.RUNTIME_ONLY.sub("", text)
    for ours, theirs in generate.CLASS_NAMES:
        text = re.sub(rf"\b{ours}\b", theirs, text)
    text = re.sub(r"^(\s*)from ([\w.]+) import (\w+)$", _from_package, text, flags=re.M)
    for ours in sorted(MODULES, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(ours)}\b", MODULES[ours], text)
    for ours, theirs in generate.OVERLAY_NAMES + NAMES:
        text = text.replace(ours, theirs)
    return text


def new_modules(module) -> list[str]:
    """The overlay modules the patch module needs (transitively), each
    before the modules that import it."""
    order: list[str] = []

    def visit(name: str, path: pathlib.Path) -> None:
        rel = str(path.relative_to(ROOT))
        source = RUNTIME_ONLY.sub("", path.read_text())  # not staged
        for _, imported, attr in static_imports.imports(source, rel, "vllm_overlay"):
            for candidate in (f"{imported}.{attr}", imported):
                if candidate in (RUNTIME, name) or candidate in order:
                    continue
                if generate.source_path(candidate).is_file():
                    visit(candidate, generate.source_path(candidate))
                    order.append(candidate)
                    break

    visit(module.__name__, pathlib.Path(module.__file__))
    missing = [m for m in order if m not in MODULES]
    if missing:
        raise SystemExit(f"no upstream module name for {missing} (add to MODULES)")
    return order


def upstream_file(module: str) -> str:
    path = MODULES[module].replace(".", "/")
    is_package = generate.source_path(module).name == "__init__.py"
    return path + ("/__init__.py" if is_package else ".py")


def edited_file(root: pathlib.Path, patch) -> str:
    """The upstream file whose code the patch's edit changes: its module's,
    or, for a function that module imports from another (the runtime
    replaces the imported name), the defining module's, when the patched
    module is the only one that calls it (so the edit changes no other
    caller)."""
    tree = static_imports.Tree(root, {})
    path = tree.module_path(patch.module)
    if path is None:
        raise SystemExit(f"vLLM {LATEST_VERSION} has no module {patch.module}")
    defined = render_patch.imported_from(tree.text(path), patch.target, path)
    if defined is None:
        return path
    source = tree.module_path(defined)
    if source is None:
        raise SystemExit(f"{patch.id}: vLLM {LATEST_VERSION} has no {defined}")
    callers = sorted(
        str(f.relative_to(root))
        for f in (root / "vllm").rglob("*.py")
        if str(f.relative_to(root)) not in (path, source)
        and render_patch.calls(f.read_text(), patch.target)
    )
    if callers:
        raise SystemExit(
            f"{patch.id}: {patch.target} is imported into {path} from {source}, "
            f"whose edit would also change its callers {callers}"
        )
    return source


def diff_name(number: int, path: str) -> str:
    stem = path.removeprefix("vllm/").removesuffix(".py").removesuffix("/__init__")
    return f"{number:04d}-{stem.replace('/', '-')}.patch"


def stage(root: pathlib.Path, ruff: latest_verify.Ruff) -> list[Staged]:
    staged: list[Staged] = []
    for module in patch_modules():
        series = series_name(module)
        items: list[Staged] = []
        for overlay in new_modules(module):
            path = upstream_file(overlay)
            if root.joinpath(path).exists():
                raise SystemExit(f"{path} exists in vLLM {LATEST_VERSION}")
            if any(s.path == path for s in staged):
                continue  # an earlier series adds it
            source = generate.source_path(overlay).read_text()
            text = generate.upstream_style(rename(source), path, fmt=ruff)
            items.append(Staged("", path, overlay, True, text, ""))
        by_file: dict[str, list] = {}
        for patch in module.PATCHES:
            if patch.id not in NOT_STAGED_PATCHES:
                by_file.setdefault(edited_file(root, patch), []).append(patch)
        source = rename(pathlib.Path(module.__file__).read_text())
        for path, patches in by_file.items():
            old = (root / path).read_text()
            text = old
            for patch in patches:
                name = render_patch.function_name(patch.new)
                text = render_patch.edit(text, patch.target, source, name)
            text = ruff.format(text, path)
            items.append(Staged("", path, module.__name__, False, text, ""))
            items[-1].diff = generate._diff(old, text, path)
        for number, item in enumerate(items, start=1):
            item.name = f"{series}/{diff_name(number, item.path)}"
            if item.new:
                item.diff = generate._new_file(item.text, item.path)
        staged += items
    check(root, staged)
    return staged


def check(root: pathlib.Path, staged: list[Staged]) -> None:
    """Imports resolve (new files; added lines of edits); no overlay name."""
    tree = static_imports.Tree(root, {s.path: s.text for s in staged if s.new})
    problems = []
    for s in staged:
        added = latest_verify.added_lines(s.diff)
        if s.new:
            problems += static_imports.unresolved(tree, s.path)
        else:
            edited = static_imports.Tree(root, {**tree.staged, s.path: s.text})
            problems += static_imports.unresolved(edited, s.path, added)
        lines = s.text.splitlines()
        problems += [
            f"{s.path}:{n}: names the overlay: {lines[n - 1].strip()}"
            for n in sorted(added)
            if check_upstream.IDENTITY.search(lines[n - 1])
        ]
    if problems:
        raise SystemExit("staging problems:\n  " + "\n  ".join(problems))


def touched(root: pathlib.Path, module) -> set[str]:
    """The upstream files a series edits or imports from (in ROOT)."""
    tree = static_imports.Tree(root, {})
    paths = {tree.module_path(p.module) for p in module.PATCHES}
    sources = [pathlib.Path(module.__file__)] + [
        generate.source_path(m) for m in new_modules(module)
    ]
    for source in sources:
        rel = str(source.relative_to(ROOT))
        for _, imported, _ in static_imports.vllm_imports(source.read_text(), rel):
            paths.add(tree.module_path(imported))
    return paths - {None}


def render(root: pathlib.Path, staged: list[Staged]) -> dict[str, str]:
    """patches/latest's generated files (relative path -> text)."""
    record = json.loads(RECORD.read_text())
    differs = record["releases"].get(LATEST_VERSION, {}).get("differs", [])
    out = {s.name: s.diff for s in staged}
    lines = [
        f"# vLLM {LATEST_VERSION}: written by patches/tools/stage_latest.py from "
        f"vllm_overlay/patches/{PATCH_SET} (run on vLLM {record['reference']})",
    ]
    for module in all_patch_modules():
        series = series_name(module)
        if series in NOT_STAGED:
            ids = ", ".join(p.id for p in module.PATCHES)
            lines.append(f"# {series}: {ids}: not staged: {NOT_STAGED[series]}")
            continue
        needs = depends()[series]
        mine = [s for s in staged if s.name.startswith(series + "/")]
        ids = ", ".join(p.id for p in module.PATCHES)
        lines.append(f"# {series}: {ids} ({module.__name__})")
        for patch in module.PATCHES:
            why = NOT_STAGED_PATCHES.get(patch.id)
            if why is not None:
                lines.append(f"#   {patch.id}: not staged: {why}")
        if needs:
            lines.append(f"#   applies after {', '.join(needs)} (new files it adds)")
        moved = sorted(touched(root, module) & set(differs))
        if moved:
            lines.append(
                f"#   differs from vLLM {record['reference']} here (where it "
                f"ran; release_compat.py): {', '.join(moved)}"
            )
        lines += [s.name for s in mine]
    out["series"] = "\n".join(lines) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if stale")
    parser.add_argument(
        "--verify", action="store_true", help="--check, then apply, hooks, compile"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="never download the sdist or install the pinned tools",
    )
    args = parser.parse_args(argv)
    sdist = latest_verify.sdist_path(LATEST_VERSION, fetch=not args.offline)
    if sdist is None:
        return 2
    scratch = latest_verify.scratch()
    with tempfile.TemporaryDirectory(prefix="vllm-stage-", dir=scratch) as tmp:
        root = check_upstream.extract(sdist, pathlib.Path(tmp) / "sdist")
        ruff = latest_verify.Ruff(root, install=not args.offline)
        staged = stage(root, ruff)
        files = render(root, staged)
        if not (args.check or args.verify):
            for old in OUT.glob("*/*.patch"):
                old.unlink()
            latest_verify.write(files, OUT)
            print(f"wrote {len(staged)} diffs to {OUT.relative_to(ROOT)}")
            return 0
        made = pathlib.Path(tmp) / "latest"
        latest_verify.write(files, made)
        stale = latest_verify.compare(made, OUT, HAND_WRITTEN)
        if stale:
            print(
                "stale (run python patches/tools/stage_latest.py):", *stale, sep="\n  "
            )
            return 1
        print(
            f"patches/latest is up to date: {len(staged)} diffs, vLLM {LATEST_VERSION}"
        )
        if args.verify:  # the tree is still the clean sdist: staging reads only
            problems = latest_verify.verify(
                root, OUT / "series", LATEST_VERSION, not args.offline
            )
            if problems:
                print("FAILED:", *problems, sep="\n  ")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
