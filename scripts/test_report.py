"""The closing table of ``scripts/test.sh``: each suite's wall time and test
counts, the total with the harness build, and every skip with its reason.

Reads what the test command leaves behind:

* tox's result json (``tox --result-json FILE``), one file per tox call:
  each environment's wall time and whether it passed;
* pytest's junit xml per environment (``[testenv] setenv`` in tox.ini
  points ``--junitxml`` at ``<reports>/<env>.xml``): passed, failed,
  errors, skipped, and each skip's reason.

An environment that ran no pytest (lint) shows ``-`` for its counts; one
whose junit file is missing although pytest should have run (killed, or a
crash before the end of the session) says so.

    python scripts/test_report.py --reports .tox/reports \\
        --setup-seconds 12 --total-seconds 2900
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import xml.etree.ElementTree as ET


@dataclasses.dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    skips: list[tuple[str, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Suite:
    name: str
    seconds: float
    ok: bool
    counts: Counts | None = None
    note: str = ""


def junit_counts(path: pathlib.Path) -> Counts:
    """Outcomes of every testcase in a pytest junit file (a test with a
    failure and a teardown error counts once, as failed)."""
    counts = Counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts.failed += 1
        elif case.find("error") is not None:
            counts.errors += 1
        elif (skip := case.find("skipped")) is not None:
            counts.skipped += 1
            reason = skip.get("message") or (skip.text or "").strip()
            # its first line (some reasons go on with a server's log)
            reason = next((ln.strip() for ln in reason.splitlines() if ln.strip()), "")
            if len(reason) > 200:
                reason = reason[:199] + "…"
            counts.skips.append((test, reason))
        else:
            counts.passed += 1
    return counts


def tox_suites(result_json: pathlib.Path) -> list[Suite]:
    """Environments that ran in one tox call, in tox's order."""
    data = json.loads(result_json.read_text())
    suites = []
    for name, env in data.get("testenvs", {}).items():
        result = env.get("result")
        if not result:  # listed in env_list but not run by this call
            continue
        suites.append(
            Suite(name, float(result.get("duration", 0.0)), bool(result["success"]))
        )
    return suites


def collect(reports: pathlib.Path) -> list[Suite]:
    """Suites of every ``*.tox.json`` in REPORTS (in file name order), with
    the counts of ``<env>.xml`` where pytest wrote one."""
    suites: list[Suite] = []
    for result_json in sorted(reports.glob("*.tox.json")):
        for suite in tox_suites(result_json):
            junit = reports / f"{suite.name}.xml"
            if junit.exists():
                try:
                    suite.counts = junit_counts(junit)
                except ET.ParseError as exc:  # two pytest runs wrote it at once
                    suite.note = f"{junit.name} unreadable ({exc})"
            suites.append(suite)
    return suites


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def render(
    suites: list[Suite], setup_seconds: float | None, total_seconds: float | None
) -> str:
    rows = [("suite", "result", "wall", "passed", "failed", "errors", "skipped")]
    for s in suites:
        c = s.counts
        numbers = (
            ("-",) * 4
            if c is None
            else (str(c.passed), str(c.failed), str(c.errors), str(c.skipped))
        )
        rows.append((s.name, "ok" if s.ok else "FAILED", _clock(s.seconds), *numbers))
    if setup_seconds is not None:
        rows.append(("harness set-up", "", _clock(setup_seconds), "", "", "", ""))
    counted = [s.counts for s in suites if s.counts is not None]
    total = [
        str(sum(getattr(c, field) for c in counted))
        for field in ("passed", "failed", "errors", "skipped")
    ]
    wall = total_seconds
    if wall is None:
        wall = sum(s.seconds for s in suites) + (setup_seconds or 0.0)
    rows.append(("total", "", _clock(wall), *total))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    missing = [s.name for s in suites if s.counts is None and not s.ok and not s.note]
    if missing:
        lines.append(
            "no test counts for failed suite(s) "
            f"{', '.join(missing)}: pytest wrote no report (killed, or not pytest)"
        )
    lines += [f"{s.name}: {s.note}" for s in suites if s.note]
    skips = [
        (s.name, test, why) for s in suites if s.counts for test, why in s.counts.skips
    ]
    lines.append("")
    if skips:
        lines.append(f"skipped tests ({len(skips)}), with their reasons:")
        lines += [f"  [{env}] {test}: {why}" for env, test, why in skips]
    else:
        lines.append("skipped tests: none")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=pathlib.Path, required=True)
    parser.add_argument("--setup-seconds", type=float)
    parser.add_argument("--total-seconds", type=float)
    args = parser.parse_args(argv)
    suites = collect(args.reports)
    if not suites:
        print(f"test report: no tox result json in {args.reports}", file=sys.stderr)
        return 1
    print(render(suites, args.setup_seconds, args.total_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
