"""patches/latest: the vLLM 0.32 runtime patches (vllm_overlay/patches/v0_32)
staged on the newest vLLM release by patches/tools/stage_latest.py, their
edits rendered by patches/tools/render_patch.py."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "patches" / "tools"
LATEST = ROOT / "patches" / "latest"
sys.path.insert(0, str(TOOLS))
import fetch_sdist  # noqa: E402
import render_patch  # noqa: E402
import stage_latest  # noqa: E402
import static_imports  # noqa: E402


def _sdist_or_fail() -> pathlib.Path:
    version = stage_latest.LATEST_VERSION
    hit = fetch_sdist.cached(version)
    if hit is None:
        try:
            hit = fetch_sdist.fetch(version)
        except Exception as exc:  # no network: a set-up gap, not a skip
            pytest.fail(
                f"the vLLM {version} sdist is not cached in "
                f"{fetch_sdist.cache_dir()} and cannot be downloaded ({exc}); "
                f"run python patches/tools/fetch_sdist.py --version {version}",
                pytrace=False,
            )
    return hit


def test_staging_is_current_applies_compiles_and_passes_the_hooks():
    """``stage_latest.py --verify``: patches/latest equals a fresh staging
    byte for byte (imports of the staged code resolve in the newest sdist,
    no added line names the overlay), every diff applies in order with
    ``git apply --check`` and ``patch --dry-run -p1 -F0``, the newest
    release's offline pre-commit hooks pass and every touched file
    compiles.  Offline: a pinned tool not at hand is skipped, not installed."""
    _sdist_or_fail()
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


def test_one_series_per_v0_32_patch_module_in_order():
    listed = [
        line
        for line in (LATEST / "series").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    on_disk = sorted(str(p.relative_to(LATEST)) for p in LATEST.glob("*/*.patch"))
    assert sorted(listed) == on_disk
    groups = list(dict.fromkeys(line.split("/")[0] for line in listed))
    assert groups == stage_latest.series_names()
    from vllm_overlay.patches import v0_32

    named = [stage_latest.series_name(m) for m in v0_32.MODULES]
    # every patch module is staged, but the wrappers render_wrapper.py
    # cannot turn into an edit (listed in the series with the reason)
    assert groups == [n for n in named if n not in stage_latest.NOT_STAGED]
    series = (LATEST / "series").read_text()
    for name, why in stage_latest.NOT_STAGED.items():
        assert f"not staged: {why}" in series
    # engine-core needs the budget modules arg-utils adds and the idle
    # wait cpu-offload-spec adds
    assert stage_latest.depends()["engine-core"] == ["arg-utils", "cpu-offload-spec"]
    assert "# engine-core: PP32-04" in series
    assert "#   applies after arg-utils, cpu-offload-spec (new files it adds)" in series
    assert stage_latest.LATEST_VERSION in (LATEST / "README.md").read_text()


def test_new_files_are_the_overlay_modules_a_patch_needs():
    """Found from the imports (inside functions too), the runtime's patch
    machinery aside, each after the modules it imports."""
    from vllm_overlay.patches.v0_32 import patch_cpu_attn, patch_cpu_offload_spec

    assert stage_latest.new_modules(patch_cpu_attn) == []
    assert stage_latest.new_modules(patch_cpu_offload_spec) == [
        "vllm_overlay.core.ops.triton_kernels",
        "vllm_overlay.core.ops.block_copy",
        "vllm_overlay.core.offload.host_copy",
        "vllm_overlay.core.idle_wait",
        "vllm_overlay.integration.v0_32.idle_wait",
        "vllm_overlay.integration.v0_32.offload_worker",
    ]


# -- the rendering convention (render_patch) ----------------------------------
UPSTREAM = '''\
from vllm.platforms import current_platform


class Spec:
    @classmethod
    def layouts(cls) -> tuple[str, ...]:
        # only one
        return ("LBHNC",)

    @override
    def get_worker(self, kv_caches: list) -> object:
        """Upstream's docstring."""
        if not self._worker:
            self._worker = make(kv_caches)
        return self._worker
'''

PATCH = """\
from vllm_overlay.core.patching import REGISTRY, Patch

PATCH_ID = "X-01"


@classmethod
def layouts(cls):
    return ("LBHNC", "BLHNC")


def get_worker(self, kv_caches):
    from vllm.platforms import current_platform

    # runtime only: begin
    record_call()
    # runtime only: end
    if not current_platform.is_cpu():
        return REGISTRY.original(PATCH_ID)(self, kv_caches)
    if self._worker is None:
        self._worker = CPUWorker(kv_caches)
    return self._worker


def added(self):
    return 1


def bad(self, other):
    return 1


def wrapper(self, kv_caches):
    worker = REGISTRY.original(PATCH_ID)(self, kv_caches)
    from vllm.platforms import current_platform

    check(worker, current_platform)
    return worker


def prelude(self, kv_caches):
    kv_caches = pinned(kv_caches)
    return REGISTRY.original(PATCH_ID)(self, kv_caches)


@classmethod
def classmethod_wrapper(cls):
    layouts = REGISTRY.original(PATCH_ID).__func__(cls)
    return layouts + ("BLHNC",)


def not_passed_through(self, kv_caches):
    return REGISTRY.original(PATCH_ID)(self, [])


def twice(self, kv_caches):
    REGISTRY.original(PATCH_ID)(self, kv_caches)
    worker = REGISTRY.original(PATCH_ID)(self, kv_caches)
    return worker


def foreign(self, *args, **kwargs):
    worker = REGISTRY.original(PATCH_ID)(self, *args, **kwargs)
    check(args)
    return worker


def no_return(self, kv_caches):
    if not ok():
        return REGISTRY.original(PATCH_ID)(self, kv_caches)
    self.x = 1
"""


def worker_body(name: str, upstream: str = UPSTREAM) -> str:
    """``Spec.get_worker`` after its signature, rendered from NAME."""
    text = render_patch.edit(upstream, "Spec.get_worker", PATCH, name)
    assert "REGISTRY" not in text
    return text.split("def get_worker(self, kv_caches: list) -> object:\n")[1]


def test_a_body_is_replaced_under_upstreams_signature():
    text = render_patch.edit(UPSTREAM, "Spec.layouts", PATCH, "layouts")
    assert textwrap.dedent("""\
        @classmethod
        def layouts(cls) -> tuple[str, ...]:
            return ("LBHNC", "BLHNC")
    """) in textwrap.dedent(text.split("class Spec:\n")[1])
    assert "# only one" not in text
    assert text.count("def get_worker") == 1  # the rest unchanged
    assert text.endswith(UPSTREAM.split("    @override\n")[1])


def test_a_fallback_keeps_upstreams_body_on_its_path():
    """``if COND: return REGISTRY.original(...)`` -> the patch's path under
    ``if not COND``, then upstream's body unchanged; runtime-only lines and
    imports upstream has at top level dropped."""
    body = worker_body("get_worker")
    assert body == (
        '        """Upstream\'s docstring."""\n'
        "        if current_platform.is_cpu():\n"
        "            if self._worker is None:\n"
        "                self._worker = CPUWorker(kv_caches)\n"
        "            return self._worker\n"
        "        if not self._worker:\n"
        "            self._worker = make(kv_caches)\n"
        "        return self._worker\n"
    )
    assert "record_call" not in body


def test_a_target_upstream_lacks_is_added_to_its_class():
    text = render_patch.edit(UPSTREAM, "Spec.added", PATCH, "added")
    assert text.endswith(
        "        return self._worker\n\n    def added(self):\n        return 1\n"
    )


TWO_RETURNS = UPSTREAM.replace(
    "            self._worker = make(kv_caches)\n",
    "            return make(kv_caches)\n",
)


@pytest.mark.parametrize(
    "upstream, target, name, error",
    [
        (UPSTREAM, "Spec.get_worker", "bad", "parameters"),
        (UPSTREAM, "Spec.get_worker", "no_return", "must end in return"),
        (UPSTREAM, "Spec.get_worker", "not_passed_through", "through"),
        (UPSTREAM, "Spec.get_worker", "twice", "REGISTRY other than"),
        (UPSTREAM, "Spec.get_worker", "foreign", "does not take"),
        (TWO_RETURNS, "Spec.get_worker", "wrapper", "only return"),
        (UPSTREAM, "Other.get_worker", "get_worker", "no class"),
        (UPSTREAM, "Spec.get_worker", "missing", "no top-level def"),
    ],
)
def test_what_does_not_follow_the_convention_is_refused(upstream, target, name, error):
    with pytest.raises(render_patch.RenderError, match=error):
        render_patch.edit(upstream, target, PATCH, name)


def test_a_wrappers_steps_after_the_call_replace_upstreams_return():
    """``NAME = REGISTRY.original(...)(params)``, steps, ``return``: the
    steps replace upstream's last (and only) return, NAME bound to what
    upstream returned; imports upstream has at top level dropped."""
    body = worker_body("wrapper")
    assert body == (
        '        """Upstream\'s docstring."""\n'
        "        if not self._worker:\n"
        "            self._worker = make(kv_caches)\n"
        "        worker = self._worker\n"
        "        check(worker, current_platform)\n"
        "        return worker\n"
    )
    # upstream returns an expression: bound to the wrapper's name first
    text = render_patch.edit(UPSTREAM, "Spec.layouts", PATCH, "classmethod_wrapper")
    assert (
        '        # only one\n        layouts = ("LBHNC",)\n'
        '        return layouts + ("BLHNC",)\n' in text
    )
    # upstream returns a name: the wrapper's name becomes it
    named = UPSTREAM.replace(
        "        return self._worker\n", "        w = self._worker\n        return w\n"
    )
    assert worker_body("wrapper", named).endswith(
        "        w = self._worker\n"
        "        check(w, current_platform)\n"
        "        return w\n"
    )


def test_a_wrappers_steps_before_the_call_open_upstreams_body():
    body = worker_body("prelude")
    assert body.startswith(
        '        """Upstream\'s docstring."""\n'
        "        kv_caches = pinned(kv_caches)\n"
        "        if not self._worker:\n"
    )


def test_a_function_imported_into_the_patched_module_is_edited_where_defined():
    core = "from vllm.v1.core.utils import (\n    get_configs,\n)\nx = get_configs()\n"
    assert render_patch.imported_from(
        core, "get_configs", "vllm/v1/engine/core.py"
    ) == ("vllm.v1.core.utils")
    relative = "from ..core.utils import get_configs\n"
    assert render_patch.imported_from(
        relative, "get_configs", "vllm/v1/engine/core.py"
    ) == ("vllm.v1.core.utils")
    assert (
        render_patch.imported_from("def get_configs(): ...\n", "get_configs", "a.py")
        is None
    )
    assert render_patch.imported_from(core, "Cls.get_configs", "a.py") is None
    assert render_patch.calls(core, "get_configs")
    assert render_patch.calls("m.get_configs(1)\n", "get_configs")
    assert not render_patch.calls('"""get_configs()"""\n', "get_configs")


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
    tree = static_imports.Tree(tmp_path, staged)
    problems = static_imports.unresolved(tree, "vllm/c/d.py")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "vllm.a import missing: vllm/a/__init__.py does not define missing",
        "vllm.nope: no module vllm.nope",
        "vllm.a.b import z: vllm/a/b.py does not define z",
    ]


def test_each_series_is_one_commit_naming_no_overlay():
    """build_mbox.py's commits for patches/latest: one per series, all its
    diffs; the text is checked against check_upstream.IDENTITY."""
    commits = stage_latest.commits()
    assert list(commits) == stage_latest.series_names()
    for series, [(subject, body, numbers)] in commits.items():
        assert subject.startswith("[") and body
        on_disk = sorted(p.name[:4] for p in (LATEST / series).glob("*.patch"))
        assert numbers == on_disk
