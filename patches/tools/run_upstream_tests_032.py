"""Run vLLM 0.32.0's (or 0.33.0's) own tests with and without the overlay; compare.

    python patches/tools/run_upstream_tests_032.py            # SELECT, both runs
    python patches/tools/run_upstream_tests_032.py --keep -k factory
    python patches/tools/run_upstream_tests_032.py --python .venv-0.32/bin/python
    python patches/tools/run_upstream_tests_032.py --version 0.33.0

The tests of the modules the v0_32 set patches or plugs into (``SELECT``:
``tests/v1/kv_offload``, the offloading connector's unit tests,
``tests/engine/test_arg_utils.py``) come from the cached sdist
(``fetch_sdist.py --version 0.32.0``), extracted into a temporary tree
that is the working directory, rootdir and ``PYTHONPATH`` (with an ini of
its own and without ``PYTEST_ADDOPTS``: no configuration of this project is
read).  They run against the
installed vLLM of the 0.32 harness (``--python``, default
``$OVERLAY_VENV_0_32/bin/python``, else ``.venv-0.32/bin/python``), twice:
with ``VLLM_OVERLAY_DISABLE=1`` (stock) and without (the overlay).  In both
runs vLLM's general plugins are loaded once at session start, as every
vLLM process does, so the overlay's patches are in place for every test.
What each release runs and leaves out, and its harness, is in
``upstream_test_lists.py`` (``RELEASES``, by ``--version``).

Offline, the tests that build a model config find one: the tree holds a
Hugging Face cache (``HUB_MODELS``, ``HF_HUB_CACHE``) with the
``config.json`` of the models they name (``facebook/opt-125m``: the
connector's scheduler and events tests; ``Qwen/Qwen3-0.6B``, EngineArgs'
default) and an empty snapshot for the placeholder names of
test_arg_utils.py (offline, ``EngineArgs`` resolves every model name to a
snapshot folder).  Without it 131 tests failed alike in both runs (100 of
them the connector's scheduler tests, which OF32-06 patches) and compared
nothing.  No weights: vLLM inspects each architecture once in a
subprocess and caches it (``$VLLM_CACHE_ROOT/modelinfos``).

After each test, vLLM's tests/conftest.py runs
``cleanup_dist_env_and_memory()``, whose ``gc.collect()`` of every
generation (with vLLM, torch and the tests imported) took 1.6 s a call
measured alone (load average 9) and 5 s a test in the runs: most of a
run's time.  The plugin marks
every test ``skip_global_cleanup`` (upstream's own opt-out for tests that
hold no GPU memory) and does the rest of that cleanup itself (the envs
cache, model-parallel groups, the distributed environment;
``gc.collect(1)``).  None of the selected tests sets up a distributed
environment or holds GPU memory.

Left out (each release's ``deselect``, ``deselect_tests``, with why):
what needs a GPU (CUDA streams and kernels), what needs a network or
another process (NIXL, ZMQ), what runs only in spawned processes (no
plugin loads there), and the two engine tests on a model's weights.

Measured on a 2-core machine shared with other test runs
(``python patches/tools/run_upstream_tests_032.py --python
.venv-0.32/bin/python``): 1042 tests a run, 1032 passed and 10 skipped in
both.  Both runs at once, with vLLM's model-info cache warm: 136 s wall
(load average 3.4-4.9) and 206 s (6-10), 81-88 s of CPU.  With it empty
(``VLLM_CACHE_ROOT``, as on a fresh machine: the scheduler and arg_utils
tests inspect OPT and Qwen3 in subprocesses): 209 s wall (load average
1.3 rising to 6), 137 s of CPU.  About 80 s of each run's wall under load
is vLLM's and the tests' imports.  Before the cache of model configs and
the lighter cleanup: 1044 tests a run, 903 passed, 10 skipped, 131 failed,
1270 s wall.

On vLLM 0.33.0 (``--version 0.33.0``: its sdist's tests, against
``.venv-0.33``, vLLM 0.33.0 built Python-only over the 0.32 harness, run
with ``VLLM_TARGET_DEVICE=cpu``, without which vLLM infers no platform):
the same SELECT, which holds what the v0_33 set patches (PT32-01 in the
connector, PP32-01..03 in ``EngineArgs``; PP33-04 wraps the engine core's
``get_kv_cache_configs``, which no selected test reaches), and 0.32's
deselections, plus the engine test
``test_tiering_cache_reset_resumes_promotions_on_idle_engine``: it starts
an ``LLM()`` with the OffloadingConnector on CPU, which failed in both
runs: stock at ``vllm._C``'s ``init_cpu_memory_env`` (the Python-only
build has no compiled extensions), with the overlay earlier, at
``create_engine_config``, by design (the connector on 0.33's CPU platform
is a CPU-platform feature the overlay refuses there; stock 0.33's
CPUOffloadingSpec refuses it too, later: its worker runs on CUDA-alike and
XPU only).  Measured (``VLLM_TARGET_DEVICE=cpu
VLLM_CACHE_ROOT=.tox/vllm-cache/0.33 python
patches/tools/run_upstream_tests_032.py --version 0.33.0 --python
.venv-0.33/bin/python``; ``VLLM_TARGET_DEVICE`` and ``--python`` are
its defaults), the model-info cache warm: 1246 tests a run, 1224 passed
and 22 skipped in both (CUDA only, or the fs tier's C extension;
``test_kvcr_tier.py`` skipped whole, no ``kvcr``, as on 0.32).  Both runs
at once: 49 s and 46 s wall (load average 1.3-2.1); the session's first
run, 92 s.

Each test's outcome (passed, failed, error, skipped) is recorded by a
small plugin in the tree; the two runs must agree test by test.  Printed:
the counts of each run, its time, the tests failing in both (listed, not
an error), and every test whose outcome differs (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

TOOLS = pathlib.Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]
sys.path.insert(0, str(TOOLS))
import fetch_sdist  # noqa: E402
from upstream_test_lists import RELEASES, Release  # noqa: E402

VERSION = "0.32.0"
MARKERS = [
    "slow_test",
    "skip_global_cleanup",
    "core_model",
    "hybrid_model",
    "cpu_model",
    "cpu_test",
    "split",
    "distributed",
    "optional",
]
DROPPED_ENV = (
    "PYTHONSTARTUP",
    "PYTEST_ADDOPTS",
    "VLLM_PLUGINS",
    "VLLM_OVERLAY_SKIP_PATCHES",
)
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# a pytest plugin in the tree: load vLLM's plugins at session start;
# append each phase's outcome as a JSON line to $OUTCOMES (as it happens:
# a run cut short leaves what it ran); after each test, vLLM's cleanup less
# its collection of every generation (see the module doc)
PLUGIN = """\
import gc, json, os, time

import pytest

_started = time.monotonic()


def _write(nodeid, outcome, seconds):
    with open(os.environ["OUTCOMES"], "a") as out:
        out.write(json.dumps([nodeid, outcome, round(seconds, 3)]) + "\\n")


def pytest_configure(config):
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm_overlay

    _write("register()", vllm_overlay.register(), time.monotonic() - _started)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


@pytest.fixture(autouse=True)
def _cleanup_without_full_collection():
    yield
    from vllm import envs
    from vllm.distributed import parallel_state

    envs.disable_envs_cache()
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    gc.collect(1)


def pytest_runtest_logreport(report):
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    else:
        outcome = "skipped" if report.skipped else "passed"
    _write(report.nodeid, outcome, report.duration)
"""

# The Hugging Face cache the runs read (HF_HUB_CACHE in the tree; they run
# offline): the models vLLM's selected tests name, each with the files they
# read.  The connector's scheduler tests build a ModelConfig of
# facebook/opt-125m (its config.json); offline, EngineArgs resolves any
# model name (test_arg_utils.py: "dummy", "m", "test", the default
# Qwen/Qwen3-0.6B) to a snapshot folder, and create_engine_config reads the
# default model's config.json.  Each config is written here by hand, not
# downloaded (no model hub here): the published model's architecture and
# sizes as we know them, not checked against the published file; the tests
# read the architecture and a few sizes, no weights, no tokenizer.
OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "hidden_size": 768,
    "word_embed_proj_dim": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
HUB_MODELS = {
    "facebook/opt-125m": {"config.json": OPT_125M},
    "Qwen/Qwen3-0.6B": {"config.json": QWEN3_06B},
    "dummy": {},
    "m": {},
    "test": {},
}
HUB_REVISION = "0" * 40

# vLLM's tests/conftest.py imports tblib for cross-process tracebacks only;
# the harness does not install it
TBLIB = "def install(*args, **kwargs):\n    pass\n"


def release(version: str) -> Release:
    """VERSION's lists and harness (upstream_test_lists.RELEASES)."""
    if version not in RELEASES:
        known = ", ".join(RELEASES)
        raise SystemExit(f"no test lists for vLLM {version} (known: {known})")
    return RELEASES[version]


def default_python(version: str = VERSION) -> pathlib.Path:
    """The python of VERSION's harness: $OVERLAY_VENV_0_3x, else .venv-0.3x."""
    lists = release(version)
    venv = os.environ.get(lists.venv_env) or str(ROOT / lists.venv)
    return pathlib.Path(venv) / "bin" / "python"


def write_hub(hub: pathlib.Path) -> None:
    """HUB_MODELS as a Hugging Face cache (HF_HUB_CACHE) at HUB."""
    for repo, files in HUB_MODELS.items():
        folder = hub / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / HUB_REVISION
        snapshot.mkdir(parents=True)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(HUB_REVISION)
        for name, content in files.items():
            (snapshot / name).write_text(json.dumps(content, indent=1))


def build_tree(tree: pathlib.Path, version: str, python: pathlib.Path) -> None:
    path = fetch_sdist.cached(version) or fetch_sdist.fetch(version)
    with tarfile.open(path) as sdist:
        prefix = sdist.getnames()[0].split("/", 1)[0] + "/"
        members = [
            m for m in sdist.getmembers() if m.name.startswith(prefix + "tests/")
        ]
        for member in members:
            member.name = member.name[len(prefix) :]
        sdist.extractall(tree, members=members, filter="data")
    (tree / "_outcomes.py").write_text(PLUGIN)
    has_tblib = subprocess.run(
        [str(python), "-c", "import tblib"], capture_output=True, check=False
    )
    if has_tblib.returncode:
        (tree / "_shim" / "tblib").mkdir(parents=True)
        (tree / "_shim" / "tblib" / "__init__.py").write_text("")
        (tree / "_shim" / "tblib" / "pickling_support.py").write_text(TBLIB)
    write_hub(tree / "hf-hub")
    lines = "".join(f"    {marker}\n" for marker in MARKERS)
    (tree / "pytest.ini").write_text(f"[pytest]\nmarkers =\n{lines}")


def run_env(
    tree: pathlib.Path, kind: str, environ: dict, defaults: dict | None = None
) -> dict:
    """The environment of one run (KIND: stock or overlay) from ENVIRON,
    with ENV_DEFAULTS and the release's DEFAULTS where ENVIRON has none."""
    env = dict(environ)
    for name, value in {**ENV_DEFAULTS, **(defaults or {})}.items():
        env.setdefault(name, value)
    # PYTEST_ADDOPTS: this project's pytest options (tox's [testenv] gives
    # each env's --junitxml, which both runs would overwrite at once)
    for name in DROPPED_ENV:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "_shim")])
    env["HF_HUB_CACHE"] = str(tree / "hf-hub")
    env["OUTCOMES"] = str(tree / f"outcomes-{kind}.json")
    env["TMPDIR"] = str(tree / f"tmp-{kind}")
    if kind == "overlay":
        env.pop("VLLM_OVERLAY_DISABLE", None)
    else:
        env["VLLM_OVERLAY_DISABLE"] = "1"
    return env


def start(tree, python, lists: Release, overlay: bool, pytest_args: list[str]):
    """Start one run (stock or the overlay) of LISTS' tests; see ``finish``."""
    kind = "overlay" if overlay else "stock"
    env = run_env(tree, kind, dict(os.environ), lists.env)
    os.makedirs(env["TMPDIR"])
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "_outcomes", "-c", str(tree / "pytest.ini")]
    command += ["--rootdir", str(tree), "--basetemp", str(tree / f".pytest-{kind}")]
    command += [f"--ignore={path}" for path in lists.deselect]
    command += [f"--deselect={test}" for test in lists.deselect_tests]
    if not any(a.startswith("tests/") for a in pytest_args):
        command += lists.select
    log = open(tree / f"{kind}.log", "w")  # noqa: SIM115 - closed in finish
    proc = subprocess.Popen(
        command + pytest_args, cwd=tree, env=env, stdout=log, stderr=log
    )
    return kind, proc, log, time.monotonic(), pathlib.Path(env["OUTCOMES"])


def finish(run) -> tuple[dict, float]:
    """Wait for RUN; each test's outcome and the run's seconds."""
    kind, proc, log, started, outcomes = run
    proc.wait()
    elapsed = time.monotonic() - started
    log.close()
    if not outcomes.exists():
        tail = pathlib.Path(log.name).read_text()[-3000:]
        raise SystemExit(f"the {kind} run wrote no outcomes:\n{tail}")
    results: dict[str, str] = {}
    for line in outcomes.read_text().splitlines():
        test, outcome, _ = json.loads(line)
        # a test's phases: a failure or a skip in any phase is its outcome
        if results.get(test, "passed") == "passed":
            results[test] = outcome
    registered = results.pop("register()", None)
    expected = "disabled by VLLM_OVERLAY_DISABLE" if kind == "stock" else "applied"
    if registered != expected:
        raise SystemExit(f"register() in the {kind} run: {registered}, not {expected}")
    return results, elapsed


def counts(results: dict) -> str:
    tally: dict[str, int] = {}
    for outcome in results.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(tally.items()))


def compare(stock: dict, overlay: dict) -> tuple[list[str], list[str]]:
    """(tests failing in both, lines for each test whose outcome differs)."""
    both = sorted(
        t
        for t in stock
        if stock[t] in ("failed", "error") and overlay.get(t) in ("failed", "error")
    )
    differ = [
        f"  {test}: stock {stock.get(test, 'not run')}, "
        f"overlay {overlay.get(test, 'not run')}"
        for test in sorted(set(stock) | set(overlay))
        if stock.get(test) != overlay.get(test)
    ]
    return both, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=VERSION)
    parser.add_argument(
        "--python", type=pathlib.Path, help="default: the --version's harness"
    )
    parser.add_argument("--keep", action="store_true", help="keep the tree")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    lists = release(args.version)
    # the runs' working directory is the tree; a venv's python is a link
    # that must stay one (its venv is found from it)
    args.python = (args.python or default_python(args.version)).absolute()
    tree = pathlib.Path(tempfile.mkdtemp(prefix=f"vllm-{args.version}-tests-"))
    try:
        build_tree(tree, args.version, args.python)
        # the two runs at once (one core each)
        runs = [start(tree, args.python, lists, o, pytest_args) for o in (False, True)]
        (stock, stock_s), (overlay, overlay_s) = [finish(r) for r in runs]
    finally:
        if args.keep:
            print(f"tree: {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)
    both, differ = compare(stock, overlay)
    print(f"vLLM {args.version}'s tests, stock: {counts(stock)} ({stock_s:.0f} s)")
    print(
        f"vLLM {args.version}'s tests, overlay: {counts(overlay)} ({overlay_s:.0f} s)"
    )
    if both:
        print(f"failing in both ({len(both)}):\n" + "\n".join(f"  {t}" for t in both))
    if differ:
        print(f"different with the overlay ({len(differ)}):\n" + "\n".join(differ))
        return 1
    print("same outcome for every test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
