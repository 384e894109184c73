"""docs/see-it-work.md, run verbatim: its marked shell blocks
(tests/support/doc_recipe.py), in order, each in its own ``bash -e``, from
the clone's root, with this harness's ``vllm`` and ``python`` first on
PATH and free ports in the variables step 1 reads.

The page's claims are checked on what its steps wrote: node A answers turn
1 with the copy and writes the prompt's full blocks to the pool; node B,
which never saw turn 1, serves turn 2's prefix from the pool (its
``cached_tokens``, vLLM's hits by source, the tier's loaded blocks) and
answers the right copy, which needs every loaded block's bytes; the last
step leaves no process behind.  The engine-free tests check the page
itself: the steps parse, are valid bash, and the metrics table lists every
metric the pool tier defines.
"""

from __future__ import annotations

import json
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support.doc_recipe import (  # noqa: E402
    RecipeError,
    kill_sessions,
    recipe_steps,
    session_processes,
)
from support.served_vllm import BIN, harness_env  # noqa: E402

PAGE = ROOT / "docs" / "see-it-work.md"
BLOCK = 128  # vLLM 0.32's block size on CPU
STEP_S = 120.0  # a step that starts or asks something
SERVER_S = {"pool": 30.0, "node-a": 300.0, "node-b": 300.0}  # until it answers
STOP_S = 60.0  # the last step's processes gone
TIER = "vllm:kv_offload_pool_"


def steps() -> list[str]:
    return recipe_steps(PAGE.read_text())


# -- the page (no engine) ----------------------------------------------------
def test_the_page_has_numbered_bash_steps():
    found = steps()
    assert len(found) >= 5
    for name in ("POOL_PORT", "A_PORT", "B_PORT", "RUN"):
        assert f"{name}=${{{name}:-" in found[0], name  # a test may set it
    for i, body in enumerate(found, 1):
        check = subprocess.run(["bash", "-n", "-c", body], capture_output=True)
        assert check.returncode == 0, f"step {i}: {check.stderr.decode()}"


@pytest.mark.parametrize(
    "text, error",
    [
        ("no markers", "no '<!-- see-it-work"),
        ("<!-- see-it-work: step 1 -->\n```sh\necho\n```", "not followed"),
        (
            "<!-- see-it-work: step 1 -->\n```bash\necho 1\n```\n"
            "<!-- see-it-work: step 3 -->\n```bash\necho 3\n```",
            "expected 1..2",
        ),
        ("<!-- see-it-work: step 1 -->\n```bash\n \n```", "empty"),
    ],
)
def test_a_broken_page_is_an_error(text, error):
    with pytest.raises(RecipeError, match=re.escape(error)):
        recipe_steps(text)


def test_every_pool_tier_metric_is_explained_once():
    from vllm_overlay.integration.v0_32.pool_tier import stats

    defined = {stats.PREFIX + name + "_total" for name in stats.COUNTERS}
    defined |= {stats.PREFIX + name for name in stats.GAUGES}
    rows = re.findall(r"^\| `(vllm:kv_offload_pool_[a-z_]+)", PAGE.read_text(), re.M)
    assert sorted(rows) == sorted(defined)


# -- the recipe, run ---------------------------------------------------------
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def answers(url: str) -> bool:
    if url.startswith("redis:"):
        port = int(url.rpartition(":")[2])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def tail(path: pathlib.Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class Recipe:
    """The page's steps run one by one; the servers they start waited for
    (each within its deadline, failing at once if its process is gone)."""

    def __init__(self, run: pathlib.Path) -> None:
        self.run = run
        pool, a, b = free_ports(3)
        self.urls = {
            "pool": f"redis://127.0.0.1:{pool}",
            "node-a": f"http://127.0.0.1:{a}/health",
            "node-b": f"http://127.0.0.1:{b}/health",
        }
        self.ports = {"pool": pool, "a": a, "b": b}
        self.env = harness_env(
            PATH=f"{BIN}:{harness_env()['PATH']}",
            # This checkout's overlay, whichever the harness installed.
            PYTHONPATH=str(ROOT),
            POOL_PORT=str(pool),
            A_PORT=str(a),
            B_PORT=str(b),
            RUN=str(run),
            MODEL=None,  # the page's default: the clone's model
        )
        self.sessions: set[int] = set()
        self.outputs: dict[str, str] = {}  # a step's body -> its output
        self.ready: set[str] = set()

    def step(self, n: int, body: str) -> str:
        """Step N's block, verbatim, in a shell that has what the earlier
        steps exported (as in the one terminal a reader types them into)."""
        out_path = self.run / f"step-{n}.out"
        state = self.run / "exported.sh"
        script = (
            f'if [ -f "{state}" ]; then . "{state}"; fi\n{body}\n'
            f'export -p > "{state}"\n'
        )
        with open(out_path, "w") as out:
            proc = subprocess.Popen(
                ["bash", "-e", "-c", script],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.sessions.add(proc.pid)
        try:
            rc = proc.wait(timeout=STEP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"step {n} running after {STEP_S:.0f} s:\n{tail(out_path)}")
        output = out_path.read_text(errors="replace")
        assert rc == 0, f"step {n} failed ({rc}):\n{output[-4000:]}"
        self.outputs[body] = output
        self.wait_for_servers()
        return output

    def wait_for_servers(self) -> None:
        for name, url in self.urls.items():
            pid_file = self.run / f"{name}.pid"
            if name in self.ready or not pid_file.exists():
                continue
            pid = int(pid_file.read_text())
            log = self.run / f"{name}.log"
            deadline = time.monotonic() + SERVER_S[name]
            while not answers(url):
                assert alive(pid), f"{name} exited:\n{tail(log)}"
                assert time.monotonic() < deadline, (
                    f"{name} not answering after {SERVER_S[name]:.0f} s:\n{tail(log)}"
                )
                time.sleep(1.0)
            self.ready.add(name)

    def output_of(self, fragment: str) -> str:
        """The output of the one step whose block holds ``fragment``."""
        (out,) = [o for body, o in self.outputs.items() if fragment in body]
        return out

    def left(self, wait_s: float) -> list[int]:
        deadline = time.monotonic() + wait_s
        while True:
            pids = session_processes(self.sessions)
            if not pids or time.monotonic() > deadline:
                return pids
            time.sleep(1.0)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of Prometheus sample ``name`` over its series with ``labels``."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(
            f'{k}="{v}"' in head for k, v in labels.items()
        ):
            total += float(value)
    return total


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every step run; what they wrote, and the processes left after the
    last one (then killed: they are the steps' own)."""
    recipe = Recipe(tmp_path_factory.mktemp("see-it-work"))
    try:
        for n, body in enumerate(steps(), 1):
            recipe.step(n, body)
        left = recipe.left(STOP_S)
    finally:
        killed = kill_sessions(recipe.sessions)
    return recipe, left, killed


def read_json(run: pathlib.Path, name: str) -> dict:
    return json.loads((run / name).read_text())


def test_node_b_serves_the_prefix_from_the_pool_and_answers_the_copy(ran):
    recipe, _, _ = ran
    run = recipe.run
    request = read_json(run, "turn1.req")
    sequence, start = request["prompt"].split(" | ")
    words, k = sequence.split(), len(start.split())
    turn1, turn2 = read_json(run, "turn1.json"), read_json(run, "turn2.json")
    n = request["max_tokens"]
    # Turn 1 (node A, cold): the copy, nothing cached.
    assert turn1["choices"][0]["text"].split() == words[k : k + n]
    assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    blocks = turn1["usage"]["prompt_tokens"] // BLOCK
    assert blocks >= 1
    # Turn 2 (node B): turn 1's full blocks from the pool, the right copy.
    assert turn2["choices"][0]["text"].split() == words[k + n : k + 2 * n]
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    metrics = (run / "metrics-b.txt").read_text()
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert metric(metrics, by_source, source="external_unspecified") == blocks * BLOCK
    assert metric(metrics, by_source, source="host") == 0
    assert metric(metrics, by_source, source="device") == 0
    assert metric(metrics, TIER + "loaded_blocks_total") == blocks
    assert metric(metrics, TIER + "lookups_total") == 1
    assert metric(metrics, TIER + "hits_total") == blocks
    assert metric(metrics, TIER + "misses_total") == 0
    # The steps show them: node B's counters, and node A's (one lookup,
    # every block missed, then stored), as the page says.
    shown_b = recipe.output_of('"$RUN/metrics-b.txt"')
    assert metric(shown_b, by_source, source="external_unspecified") == blocks * BLOCK
    assert metric(shown_b, TIER + "loaded_blocks_total") == blocks
    shown_a = recipe.output_of('"http://127.0.0.1:$A_PORT/metrics"')
    assert metric(shown_a, TIER + "lookups_total") == 1
    assert metric(shown_a, TIER + "misses_total") == blocks
    assert metric(shown_a, TIER + "stored_blocks_total") == blocks
    for node in ("a", "b"):
        log = tail(run / f"node-{node}.log", 10**7)
        assert "vllm-overlay KV pool tier: redis://127.0.0.1:" in log, node


def test_the_last_step_stops_every_process(ran):
    recipe, left, killed = ran
    assert left == [], f"still running after the last step: {killed}"
    for name in ("pool", "node-a", "node-b"):
        assert not alive(int((recipe.run / f"{name}.pid").read_text())), name
