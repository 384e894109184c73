"""Write the offloading and shared-pool series from the runtime modules.

    python patches/generate.py           # (re)write the diffs (and test diffs)
    python patches/generate.py --check   # exit 1 if a committed diff is stale

These features are new code rather than edits of upstream functions, so
their diffs add the overlay's modules to the vLLM tree under upstream module
names (imports rewritten by ``MODULES``) and register the connectors and the
offloading spec in vLLM's factories.  Every series (hand-written ones too)
also gets its upstream tests (``patches/upstream-tests``, listed in
``tools/run_upstream_tests.TESTS``) as new-file diffs after its own.
``tests/unit/test_patch_series.py`` runs ``--check``: a runtime module that
changes without its diff fails.

A new file is written in vLLM's style (``upstream_style``): the SPDX header,
``init_logger(__name__)`` for the overlay's ``logging.getLogger``, Triton
through ``vllm.triton_utils``, ``import regex as re``; then ruff 0.14 (the
version vLLM 0.11.2's pre-commit pins, this interpreter's ``-m ruff``) fixes
and formats the text with vLLM's ruff settings (``VLLM_RUFF``).
``patches/tools/check_upstream.py`` runs vLLM's hooks on the patched tree.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"

# overlay module -> upstream module (cross-layer ones come from that series)
_KV = "vllm.distributed.kv_transfer.kv_connector.v1"
_POOL = "vllm_overlay.connectors.shared_pool"
MODULES = {
    "vllm_overlay.core.kv_layout": "vllm.v1.kv_cache_layout",
    "vllm_overlay.integration.cross_layer": "vllm.v1.worker.cross_layer_kv",
    "vllm_overlay.core.ops.block_copy": "vllm.v1.kv_offload.block_copy",
    "vllm_overlay.core.ops.triton_kernels": "vllm.v1.kv_offload.block_copy_triton",
    "vllm_overlay.integration.kv_tables": "vllm.v1.kv_offload.kv_tables",
    "vllm_overlay.integration.model_kv": "vllm.v1.kv_offload.model_kv",
    "vllm_overlay.core.offload.mapping": "vllm.v1.kv_offload.worker.sub_blocks",
    "vllm_overlay.core.offload.host_copy": "vllm.v1.kv_offload.worker.host_copy",
    "vllm_overlay.core.offload.mover": "vllm.v1.kv_offload.worker.block_mover",
    "vllm_overlay.connectors.offloading": f"{_KV}.cross_layer_offloading_connector",
    "vllm_overlay.core.pool.codec": f"{_KV}.shared_pool.codec",
    "vllm_overlay.core.pool.config": f"{_KV}.shared_pool.config",
    "vllm_overlay.core.pool.errors": f"{_KV}.shared_pool.errors",
    "vllm_overlay.core.pool.ratelog": f"{_KV}.shared_pool.ratelog",
    "vllm_overlay.core.pool.resp": f"{_KV}.shared_pool.resp",
    "vllm_overlay.core.pool.transport": f"{_KV}.shared_pool.transport",
    "vllm_overlay.core.pool.health": f"{_KV}.shared_pool.health",
    "vllm_overlay.core.pool.stats": f"{_KV}.shared_pool.stats",
    "vllm_overlay.core.pool.jobs": f"{_KV}.shared_pool.jobs",
    "vllm_overlay.core.pool.failures": f"{_KV}.shared_pool.failures",
    "vllm_overlay.core.pool.lookups": f"{_KV}.shared_pool.lookups",
    "vllm_overlay.core.pool.stores": f"{_KV}.shared_pool.stores",
    "vllm_overlay.core.pool.loads": f"{_KV}.shared_pool.loads",
    "vllm_overlay.core.pool.pool": f"{_KV}.shared_pool.pool",
    "vllm_overlay.core.pool.keys": f"{_KV}.shared_pool.keys",
    "vllm_overlay.core.pool.flights": f"{_KV}.shared_pool.flights",
    "vllm_overlay.core.pool.refusals": f"{_KV}.shared_pool.refusals",
    "vllm_overlay.core.pool": f"{_KV}.shared_pool",
    "vllm_overlay.connectors.shared_pool": f"{_KV}.shared_pool_connector",
    f"{_POOL}.common": f"{_KV}.shared_pool_connector.common",
    f"{_POOL}.scheduler": f"{_KV}.shared_pool_connector.scheduler",
    f"{_POOL}.staging": f"{_KV}.shared_pool_connector.staging",
    f"{_POOL}.loads": f"{_KV}.shared_pool_connector.loads",
    f"{_POOL}.worker": f"{_KV}.shared_pool_connector.worker",
}

FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
SPEC_FACTORY = "vllm/v1/kv_offload/factory.py"


def _register(name: str, module: str) -> str:
    return (
        f'\nKVConnectorFactory.register_connector(\n    "{name}",\n'
        f'    "{module}",\n    "{name}",\n)\n'
    )


# the overlay's product names -> the names the classes get in vLLM's tree
CLASS_NAMES = [
    ("OverlayOffloadingConnector", "CrossLayerOffloadingConnector"),
    ("OverlayCPUOffloadingSpec", "CrossLayerCPUOffloadingSpec"),
]

OFFLOADING_REGISTRATION = _register(
    "CrossLayerOffloadingConnector", MODULES["vllm_overlay.connectors.offloading"]
)
POOL_REGISTRATION = _register(
    "SharedKVPoolConnector", MODULES["vllm_overlay.connectors.shared_pool"]
)
SPEC_REGISTRATION = (
    '\nOffloadingSpecFactory.register_spec(\n    "CrossLayerCPUOffloadingSpec",\n'
    f'    "{MODULES["vllm_overlay.connectors.offloading"]}",\n'
    '    "CrossLayerCPUOffloadingSpec",\n)\n'
)

# series -> [(diff name, kind, argument)]; kind "new": an overlay module as
# a new upstream file; "append": text appended to an upstream file (the
# text of earlier appends to the same file is part of the context).
SERIES = {
    "offloading": [
        (
            "0001-v1-kv_offload-block_copy.patch",
            "new",
            "vllm_overlay.core.ops.block_copy",
        ),
        (
            "0002-v1-kv_offload-block_copy_triton.patch",
            "new",
            "vllm_overlay.core.ops.triton_kernels",
        ),
        (
            "0003-v1-kv_offload-kv_tables.patch",
            "new",
            "vllm_overlay.integration.kv_tables",
        ),
        (
            "0004-v1-kv_offload-model_kv.patch",
            "new",
            "vllm_overlay.integration.model_kv",
        ),
        (
            "0005-v1-kv_offload-worker-sub_blocks.patch",
            "new",
            "vllm_overlay.core.offload.mapping",
        ),
        (
            "0006-v1-kv_offload-worker-host_copy.patch",
            "new",
            "vllm_overlay.core.offload.host_copy",
        ),
        (
            "0007-v1-kv_offload-worker-block_mover.patch",
            "new",
            "vllm_overlay.core.offload.mover",
        ),
        (
            "0008-kv_connector-v1-cross_layer_offloading_connector.patch",
            "new",
            "vllm_overlay.connectors.offloading",
        ),
        (
            "0009-kv_connector-factory-offloading.patch",
            "append",
            (FACTORY, OFFLOADING_REGISTRATION),
        ),
        (
            "0010-v1-kv_offload-factory.patch",
            "append",
            (SPEC_FACTORY, SPEC_REGISTRATION),
        ),
    ],
    "shared-pool": [
        (
            "0001-kv_connector-v1-shared_pool-init.patch",
            "new",
            "vllm_overlay.core.pool",
        ),
        (
            "0002-kv_connector-v1-shared_pool-codec.patch",
            "new",
            "vllm_overlay.core.pool.codec",
        ),
        (
            "0003-kv_connector-v1-shared_pool-config.patch",
            "new",
            "vllm_overlay.core.pool.config",
        ),
        (
            "0004-kv_connector-v1-shared_pool-errors.patch",
            "new",
            "vllm_overlay.core.pool.errors",
        ),
        (
            "0005-kv_connector-v1-shared_pool-ratelog.patch",
            "new",
            "vllm_overlay.core.pool.ratelog",
        ),
        (
            "0006-kv_connector-v1-shared_pool-resp.patch",
            "new",
            "vllm_overlay.core.pool.resp",
        ),
        (
            "0007-kv_connector-v1-shared_pool-transport.patch",
            "new",
            "vllm_overlay.core.pool.transport",
        ),
        (
            "0008-kv_connector-v1-shared_pool-health.patch",
            "new",
            "vllm_overlay.core.pool.health",
        ),
        (
            "0009-kv_connector-v1-shared_pool-keys.patch",
            "new",
            "vllm_overlay.core.pool.keys",
        ),
        (
            "0010-kv_connector-v1-shared_pool-stats.patch",
            "new",
            "vllm_overlay.core.pool.stats",
        ),
        (
            "0011-kv_connector-v1-shared_pool-jobs.patch",
            "new",
            "vllm_overlay.core.pool.jobs",
        ),
        (
            "0012-kv_connector-v1-shared_pool-failures.patch",
            "new",
            "vllm_overlay.core.pool.failures",
        ),
        (
            "0013-kv_connector-v1-shared_pool-lookups.patch",
            "new",
            "vllm_overlay.core.pool.lookups",
        ),
        (
            "0014-kv_connector-v1-shared_pool-stores.patch",
            "new",
            "vllm_overlay.core.pool.stores",
        ),
        (
            "0015-kv_connector-v1-shared_pool-loads.patch",
            "new",
            "vllm_overlay.core.pool.loads",
        ),
        (
            "0016-kv_connector-v1-shared_pool-pool.patch",
            "new",
            "vllm_overlay.core.pool.pool",
        ),
        (
            "0017-kv_connector-v1-shared_pool-flights.patch",
            "new",
            "vllm_overlay.core.pool.flights",
        ),
        (
            "0018-kv_connector-v1-shared_pool-refusals.patch",
            "new",
            "vllm_overlay.core.pool.refusals",
        ),
        (
            "0019-kv_connector-v1-shared_pool_connector-common.patch",
            "new",
            "vllm_overlay.connectors.shared_pool.common",
        ),
        (
            "0020-kv_connector-v1-shared_pool_connector-scheduler.patch",
            "new",
            "vllm_overlay.connectors.shared_pool.scheduler",
        ),
        (
            "0021-kv_connector-v1-shared_pool_connector-staging.patch",
            "new",
            "vllm_overlay.connectors.shared_pool.staging",
        ),
        (
            "0022-kv_connector-v1-shared_pool_connector-loads.patch",
            "new",
            "vllm_overlay.connectors.shared_pool.loads",
        ),
        (
            "0023-kv_connector-v1-shared_pool_connector-worker.patch",
            "new",
            "vllm_overlay.connectors.shared_pool.worker",
        ),
        (
            "0024-kv_connector-v1-shared_pool_connector-init.patch",
            "new",
            "vllm_overlay.connectors.shared_pool",
        ),
        (
            "0025-kv_connector-factory-shared_pool.patch",
            "append",
            (FACTORY, POOL_REGISTRATION),
        ),
    ],
}


def source_path(module: str) -> pathlib.Path:
    base = ROOT / module.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def upstream_path(module: str) -> str:
    target = MODULES[module]
    path = target.replace(".", "/")
    return path + (
        "/__init__.py" if source_path(module).name == "__init__.py" else ".py"
    )


RUNTIME_ONLY = re.compile(
    r"^[ \t]*# runtime only: begin.*?^[ \t]*# runtime only: end\n", re.M | re.S
)


def rewrite(text: str, origin: str, modules: dict[str, str] | None = None) -> str:
    """TEXT with the runtime-only blocks dropped (the lines from ``# runtime
    only: begin`` to ``# runtime only: end``: what exists only because the
    overlay patches at runtime) and the overlay's module and class names
    replaced by their upstream ones."""
    modules = MODULES if modules is None else modules
    text = RUNTIME_ONLY.sub("", text)
    for ours, theirs in CLASS_NAMES:
        text = re.sub(rf"\b{ours}\b", theirs, text)
    for ours in sorted(modules, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(ours)}\b", modules[ours], text)
    if "vllm_overlay" in text:
        raise ValueError(
            f"{origin}: a vllm_overlay reference has no upstream module in MODULES"
        )
    return text


SPDX_HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
OVERLAY_LOGGER = 'logger = logging.getLogger("vllm.overlay")'
# the overlay's name in log messages, errors and thread names -> vLLM's (the
# pool's key derivation names no project: nodes on the overlay and on the
# patched tree share keys).
OVERLAY_NAMES = [
    ("vllm-overlay KV pool", "KV pool"),
    ("vllm-overlay offloading:", "offloading:"),
    ("not a vllm-overlay KV value", "not a shared KV pool value"),
    ("vllm-overlay-pool-", "vllm-kv-pool-"),
]
TRITON_IMPORTS = "import triton\nimport triton.language as tl\n"

# vLLM 0.11.2's pyproject.toml [tool.ruff*] (line length and target version
# are ruff's defaults there: 88, and py310 from requires-python); vllm is
# first-party as it is in vLLM's tree.
VLLM_RUFF = """\
line-length = 88
target-version = "py310"

[lint]
select = ["E", "F", "UP", "B", "SIM", "I", "G"]
ignore = ["F405", "F403", "E731", "B905", "B007", "UP032"]

[lint.isort]
known-first-party = ["vllm"]

[format]
docstring-code-format = true
"""


def upstream_style(text: str, path: str, fmt=None) -> str:
    """TEXT (an overlay module, imports already renamed) as vLLM writes it
    (formatted by FMT(text, path), default ``ruff``: vLLM 0.11.2's)."""
    if OVERLAY_LOGGER in text:
        text = text.replace(OVERLAY_LOGGER, "logger = init_logger(__name__)")
        init_logger = "from vllm.logger import init_logger\n"
        if re.search(r"\blogging\.", text):
            init_logger = "import logging\n" + init_logger
        text = re.sub(r"^import logging\n", init_logger, text, count=1, flags=re.M)
    for ours, theirs in OVERLAY_NAMES:
        text = text.replace(ours, theirs)
    # the overlay's layering note ("the core knows nothing of vLLM") is
    # not true inside vLLM's tree
    text = re.sub(r"Knows nothing of vLLM\.(?:  |\n)", "", text)
    text = text.replace(TRITON_IMPORTS, "from vllm.triton_utils import tl, triton\n")
    text = re.sub(r"^import re$", "import regex as re", text, flags=re.M)
    if re.search(r"^(import|from) triton\b", text, flags=re.M):
        raise ValueError(f"{path}: a direct Triton import is left")
    text = _relative_if_too_long(text, path)
    if not text.startswith(SPDX_HEADER):
        text = SPDX_HEADER + text
    return (fmt or ruff)(text, path)


def _relative_if_too_long(text: str, path: str) -> str:
    """``from <own package>.x import (`` as ``from .x import (`` where the
    absolute module name alone overflows vLLM's line length (ruff E501; the
    formatter cannot split a module name)."""
    package = path.rpartition("/")[0].replace("/", ".")

    def shorten(match: re.Match) -> str:
        line, module = match.group(0), match.group(1)
        if len(line) <= 88 or not module.startswith(package + "."):
            return line
        return line.replace(f"from {module} ", f"from .{module[len(package) + 1 :]} ")

    return re.sub(r"^from ([\w.]+) import .*$", shorten, text, flags=re.M)


def ruff(text: str, path: str) -> str:
    """TEXT fixed (safe fixes) and formatted by ruff with ``VLLM_RUFF``."""
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "ruff.toml"
        config.write_text(VLLM_RUFF)
        for args in (["check", "--fix-only", "--quiet"], ["format"]):
            done = subprocess.run(
                [sys.executable, "-m", "ruff", *args, "--config", str(config)]
                + ["--stdin-filename", path, "-"],
                input=text,
                capture_output=True,
                text=True,
                cwd=tmp,
                check=False,
            )
            if done.returncode:
                raise RuntimeError(f"ruff {args[0]} {path}: {done.stderr.strip()}")
            text = done.stdout
    return text


def _diff(old: str, new: str, path: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        f"a/{path}",
        f"b/{path}",
    )
    return "".join(lines)


def _new_file(text: str, path: str) -> str:
    lines = text.splitlines(keepends=True)
    body = "".join("+" + line for line in lines)
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


UPSTREAM_TESTS = PATCHES / "upstream-tests"
TEST_DIFF = "-tests-v1-"  # in the name of a test diff, and only there


def _upstream_tests() -> dict[str, list[str]]:
    """series -> the vLLM test files it adds (``run_upstream_tests.TESTS``)."""
    sys.path.insert(0, str(PATCHES / "tools"))
    try:
        import run_upstream_tests
    finally:
        sys.path.pop(0)
    return run_upstream_tests.TESTS


def test_diff_name(number: int, path: str) -> str:
    return f"{number:04d}-{path.removesuffix('.py').replace('/', '-')}.patch"


def render_tests() -> dict[pathlib.Path, str]:
    """Each series' upstream tests (``patches/upstream-tests``) as new-file
    diffs numbered after the series' own diffs (the generated ones, or the
    hand-written ones on disk)."""
    out = {}
    for series, paths in _upstream_tests().items():
        if series in SERIES:
            count = len(SERIES[series])
        else:
            on_disk = (PATCHES / series).glob("*.patch")
            count = sum(TEST_DIFF not in p.name for p in on_disk)
        for i, path in enumerate(paths, start=count + 1):
            text = (UPSTREAM_TESTS / path).read_text()
            out[PATCHES / series / test_diff_name(i, path)] = _new_file(text, path)
    return out


def render() -> dict[pathlib.Path, str]:
    site = pathlib.Path(importlib.util.find_spec("vllm").origin).parents[1]
    appended: dict[str, str] = {}
    out = {}
    for series, diffs in SERIES.items():
        for name, kind, arg in diffs:
            if kind == "new":
                path = upstream_path(arg)
                text = rewrite(source_path(arg).read_text(), arg)
                diff = _new_file(upstream_style(text, path), path)
            else:
                path, addition = arg
                old = appended.get(path) or (site / path).read_text()
                appended[path] = old + addition
                diff = _diff(old, appended[path], path)
            out[PATCHES / series / name] = diff
    return {**out, **render_tests()}


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for path, text in render().items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale (run python patches/generate.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
