"""Write each series as a ``git format-patch`` mbox: logical commits with a
subject and body in vLLM's PR style, authorship and ``Signed-off-by``.

The per-file diffs in ``patches/<series>/`` stay the editing units (the
generated ones come from ``patches/generate.py``); ``COMMITS`` groups them
into commits.  On the cached vLLM sdist (a git repository), each series is
built on top of the series it needs (``DEPENDS``), committed with fixed
dates (so the mboxes are reproducible byte for byte), and written to
``patches/mbox/<series>.mbox``.  ``--check`` rebuilds into a temporary
folder, compares, and then ``git am``s every mbox onto a clean tree in
``ORDER``.  patches/latest's mboxes (``LATEST``: one commit per series of
``stage_latest.py``) are not committed (``committed=False``): they are built
from its diffs, into ``patches/latest/mbox/`` (git-ignored) on request and
into a temporary folder by ``--check``, which ``git am``s them.

    python patches/tools/build_mbox.py [--check]
    python patches/tools/build_mbox.py --markdown   # README.md's PR section
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import check_upstream  # noqa: E402
import fetch_sdist  # noqa: E402
import latest_verify  # noqa: E402
import stage_latest  # noqa: E402

PATCHES = check_upstream.PATCHES
MBOX = PATCHES / "mbox"
AUTHOR = "vllm-overlay developers <vllm-overlay@users.noreply.github.com>"
DATE = "2026-11-22T00:00:00+00:00"  # fixed: reproducible commits

# Series in the order they apply; each needs the ones listed (transitively
# applied first).  shared-pool's factory registration sits after the line
# offloading adds to the same file.
ORDER = ["cross-layer", "kv-pressure", "offloading", "shared-pool", "pp-kv-budget"]
DEPENDS = {
    "cross-layer": [],
    "kv-pressure": [],
    "offloading": ["cross-layer"],
    "shared-pool": ["cross-layer", "offloading"],
    "pp-kv-budget": [],
}

# series -> [(subject, body, [diff numbers])]
COMMITS: dict[str, list[tuple[str, str, list[str]]]] = {
    "cross-layer": [
        (
            "[Attention] Report the KV cache stride order with a layers dimension",
            "Attention backends can now say where a leading num_layers\n"
            "dimension goes in their KV cache stride order\n"
            "(include_num_layers_dimension=True), so one tensor can hold the KV\n"
            "of every layer with each block's KV for all layers in one\n"
            "contiguous run. Backends that cannot take it raise\n"
            "NotImplementedError and keep the per-layer layout.\n\n"
            "Part of RFC #27742.",
            ["0001", "0002", "0003", "0004", "0005", "0006"],
        ),
        (
            "[KVConnector] Let a connector ask for cross-layer KV blocks",
            "KVConnectorBase_V1.prefer_cross_layer_blocks (default False) and\n"
            "register_cross_layers_kv_cache(kv_cache, attn_backend, layout):\n"
            "a connector that moves whole blocks opts in and receives the one\n"
            "buffer instead of per-layer tensors.\n\n"
            "Part of RFC #27742.",
            ["0007"],
        ),
        (
            "[Core] Allocate cross-layer KV blocks when the connector prefers them",
            "When the model is uniform (one KV cache group, plain attention),\n"
            "the configured KV connector prefers cross-layer blocks and the\n"
            "attention backend gives a stride order with a layers dimension,\n"
            "the model runner allocates one KV buffer for all layers and hands\n"
            "each layer a strided view; otherwise the stock layout. One log\n"
            "line says which layout was chosen and why.\n\n"
            "Implements RFC #27742 (as in PR #27743) for v0.11.2.",
            ["0008", "0009", "0010", "0011", "0012"],
        ),
    ],
    "kv-pressure": [
        (
            "[Core][KVConnector] Admit async KV loads only when they can finish",
            "Under KV cache pressure, a request waiting for an async KV load\n"
            "could hold blocks that the running requests needed, or be\n"
            "admitted with blocks that never fit its whole prompt. Admit an\n"
            "async load only when the request's prompt fits next to the blocks\n"
            "promised to the other parked requests, and schedule a request\n"
            "whose load finished as resumed.",
            ["0001", "0002", "0004"],
        ),
        (
            "[Core][KVConnector] Wait for async KV loads instead of spinning",
            "While every unfinished request waits for its async KV load and\n"
            "nothing else is pending, EngineCore.step (and the batch-queue step\n"
            "with an empty queue) waits up to 2 ms on the connector's\n"
            "wait_for_remote_kv(timeout_s) when it has one, else sleeps, instead\n"
            "of running empty steps back to back. Those ran 10^4+ times during one\n"
            "long load and held the GIL that the connector's transfer threads\n"
            "need: a 128 MiB reload from a shared KV pool took 12.5 s, 0.64 s with\n"
            "the wait. Never waits while any request can run.",
            ["0003"],
        ),
    ],
    "offloading": [
        (
            "[KVConnector] Block gather/scatter kernels for KV offloading",
            "Triton and copy-engine (DMA) paths that move KV blocks between the\n"
            "device cache and packed host buffers, with tables that describe\n"
            "a block as one run (cross-layer blocks) or one run per layer and\n"
            "K/V. A cross-layer block moves with one copy instead of\n"
            "2 x num_layers.",
            ["0001", "0002", "0003", "0004", "0005", "0006", "0007", "0011"],
        ),
        (
            "[KVConnector] Offloading connector over cross-layer blocks",
            "An offloading connector (GPU <-> host) that prefers cross-layer\n"
            "blocks and moves each block with the kernels above; registered\n"
            "in the connector and offloading-spec factories.",
            ["0008", "0009", "0010", "0012"],
        ),
    ],
    "shared-pool": [
        (
            "[KVConnector] Shared KV pool storage core (Redis/Valkey)",
            "Values with a checked header (namespace, key, layout, a checksum:\n"
            "XXH3-64 with the optional xxhash package, else CRC-32, and an\n"
            "optional keyed MAC), validated configuration, classified\n"
            "failures, and a pool client whose lookups, stores and loads all\n"
            "run on background threads, each job with a deadline: a bounded\n"
            "RESP reader, cluster-aware raw pipelines, health gates with\n"
            "back-off and a watchdog, one rate-limited logger.",
            [f"{i:04d}" for i in range(1, 19)],
        ),
        (
            "[KVConnector] SharedKVPoolConnector: share KV blocks across nodes",
            "Offloads KV blocks asynchronously to a Redis/Valkey pool shared by\n"
            "many vLLM nodes; a request whose prefix another node computed\n"
            "loads it. The scheduler never waits on the network: a lookup\n"
            "under way answers None (ask again next step); any failure means\n"
            "recompute. A request finished while its load is under way keeps\n"
            "its blocks until the load has landed. On CPU, values are read\n"
            "from the socket straight into their KV blocks.\n\n"
            "Semantics of PR #16159, reworked.",
            [f"{i:04d}" for i in range(19, 27)],
        ),
    ],
    "pp-kv-budget": [
        (
            "[Core] --enable-pp-prop-kv-cache: split the KV budget by layer share",
            "With pipeline parallelism and --kv-cache-memory-bytes, give each\n"
            "stage a share of the budget proportional to its number of layers,\n"
            "so uneven partitions get equal block counts instead of the\n"
            "smallest stage's.\n\n"
            "As proposed in PR #25164.",
            ["0001", "0002", "0003", "0004", "0005", "0006"],
        ),
    ],
}


@dataclasses.dataclass(frozen=True)
class Staging:
    """A set of series on one vLLM release: diffs in PATCHES/<series>/,
    mboxes in PATCHES/mbox/."""

    version: str
    patches: pathlib.Path
    order: list[str]
    depends: dict[str, list[str]]
    commits: dict[str, list[tuple[str, str, list[str]]]]
    committed: bool = True  # False: built on demand (git-ignored), not kept

    @property
    def mbox(self) -> pathlib.Path:
        return self.patches / "mbox"


MAIN = Staging("0.11.2", PATCHES, ORDER, DEPENDS, COMMITS)
LATEST = Staging(
    stage_latest.LATEST_VERSION,
    stage_latest.OUT,
    stage_latest.series_names(),
    stage_latest.depends(),
    stage_latest.commits(),
    committed=False,
)
STAGINGS = {"0.11.2": MAIN, "latest": LATEST}


def _env() -> dict:
    name, email = AUTHOR[: AUTHOR.index(" <")], AUTHOR[AUTHOR.index("<") + 1 : -1]
    return {
        **os.environ,
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_AUTHOR_DATE": DATE,
        "GIT_COMMITTER_DATE": DATE,
    }


def _git(tree: pathlib.Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["git", "-c", "core.autocrlf=false", *args],
        cwd=tree,
        env=_env(),
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"git {' '.join(args[:2])}: {done.stderr.strip()}")
    return done.stdout


def _diffs(series: str, staging: Staging = MAIN) -> dict[str, pathlib.Path]:
    folder = staging.patches / series
    return {p.name[:4]: p for p in sorted(folder.glob("*.patch"))}


def _needs(series: str, staging: Staging = MAIN) -> list[str]:
    """``series``'s dependencies, transitively, in order."""
    todo, seen = list(staging.depends[series]), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(staging.depends[name])
    return [name for name in staging.order if name in seen]


def commit_series(tree: pathlib.Path, series: str, staging: Staging = MAIN) -> None:
    diffs = _diffs(series, staging)
    grouped = [n for _, _, numbers in staging.commits[series] for n in numbers]
    if sorted(grouped) != sorted(diffs):
        raise SystemExit(
            f"{series}: COMMITS lists {sorted(grouped)}, the folder has {sorted(diffs)}"
        )
    for subject, body, numbers in staging.commits[series]:
        for number in numbers:
            _git(tree, "apply", "--index", str(diffs[number]))
        message = f"{subject}\n\n{body}\n\nSigned-off-by: {AUTHOR}\n"
        _git(tree, "commit", "-q", "--no-verify", "-F", "-", stdin=message)


def _reset(tree: pathlib.Path, base: str) -> None:
    _git(tree, "reset", "-q", "--hard", base)
    _git(tree, "clean", "-qfdx")


def build(out: pathlib.Path, sdist: pathlib.Path, staging: Staging = MAIN) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=latest_verify.scratch()) as tmp:
        tree = check_upstream.prepare_tree(sdist, pathlib.Path(tmp))
        clean = _git(tree, "rev-parse", "HEAD").strip()
        for series in staging.order:
            _reset(tree, clean)
            for dependency in _needs(series, staging):
                commit_series(tree, dependency, staging)
            base = _git(tree, "rev-parse", "HEAD").strip()
            commit_series(tree, series, staging)
            mbox = _git(
                tree,
                "format-patch",
                "--stdout",
                "--no-signature",
                "--zero-commit",
                "--full-index",
                f"{base}..HEAD",
            )
            (out / f"{series}.mbox").write_text(mbox)


def git_am_all(
    sdist: pathlib.Path, mboxes: pathlib.Path, staging: Staging = MAIN
) -> None:
    """Every mbox applies with ``git am`` on a clean tree, in order, each
    series also on top of only what it needs."""
    with tempfile.TemporaryDirectory(dir=latest_verify.scratch()) as tmp:
        tree = check_upstream.prepare_tree(sdist, pathlib.Path(tmp))
        clean = _git(tree, "rev-parse", "HEAD").strip()
        for series in [*staging.order, None]:
            _reset(tree, clean)
            names = (
                staging.order if series is None else [*_needs(series, staging), series]
            )
            for name in names:
                _git(
                    tree,
                    "am",
                    "-q",
                    "--whitespace=nowarn",
                    str(mboxes / f"{name}.mbox"),
                )
        count = _git(tree, "rev-list", "--count", "HEAD").strip()
        print(
            f"git am on vLLM {staging.version}: all {len(staging.order)} series "
            f"apply in order ({count} commits incl. the base)"
        )


README_BEGIN = "<!-- build_mbox.py --markdown: begin -->"
README_END = "<!-- build_mbox.py --markdown: end -->"


def _touched(diff: pathlib.Path) -> list[str]:
    return [
        line[len("+++ b/") :]
        for line in diff.read_text().splitlines()
        if line.startswith("+++ b/")
    ]


def markdown() -> str:
    """Each series' pull requests as patches/README.md lists them: title,
    description (the commit body), the files, the tests it adds."""
    out = [README_BEGIN]
    for series in ORDER:
        needs = "".join(f" + {name}" for name in _needs(series))
        out += ["", f"### {series} (`mbox/{series}.mbox`, on v0.11.2{needs})"]
        diffs = _diffs(series)
        for subject, body, numbers in COMMITS[series]:
            files = [f for n in numbers for f in _touched(diffs[n])]
            tests = [f for f in files if f.startswith("tests/")]
            code = [f for f in files if not f.startswith("tests/")]
            out += ["", f"**{subject}**", "", body]
            out += ["", "Files: " + ", ".join(f"`{f}`" for f in code) + "."]
            if tests:
                out += ["", "Tests: " + ", ".join(f"`{f}`" for f in tests) + "."]
    return "\n".join([*out, "", README_END]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument(
        "--staging",
        choices=[*STAGINGS, "all"],
        default="all",
        help="0.11.2 (patches/), latest (patches/latest/) or both",
    )
    ap.add_argument(
        "--markdown", action="store_true", help="print README.md's PR section"
    )
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(), end="")
        return 0
    chosen = (
        list(STAGINGS.values()) if args.staging == "all" else [STAGINGS[args.staging]]
    )
    stale = []
    for staging in chosen:
        sdist = fetch_sdist.fetch(staging.version)
        if not args.check:
            build(staging.mbox, sdist, staging)
            git_am_all(sdist, staging.mbox, staging)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            fresh = pathlib.Path(tmp)
            build(fresh, sdist, staging)
            if not staging.committed:  # nothing kept to compare: they git am
                git_am_all(sdist, fresh, staging)
                continue
            stale += [
                str((staging.mbox / f"{s}.mbox").relative_to(PATCHES))
                for s in staging.order
                if not (staging.mbox / f"{s}.mbox").exists()
                or (staging.mbox / f"{s}.mbox").read_text()
                != (fresh / f"{s}.mbox").read_text()
            ]
        git_am_all(sdist, staging.mbox, staging)
    if stale:
        print(f"stale mboxes (run patches/tools/build_mbox.py): {stale}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
