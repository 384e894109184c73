"""vLLM 0.32 with the overlay where the gate or a patch meets changed
upstream code, printed as JSON.

    python run_gate.py '{"case": "release", "version": "0.32.1", "change": "..."}'
    python run_gate.py '{"case": "gone", "module": "...", "name": "..."}'
    python run_gate.py '{"case": "each_file", "version": "0.32.0"}'

``release``: vLLM reports ``version`` (what the gate reads), and the gate
finds the installed package at a copy of the installed touched files (the
real ones, byte for byte), with ``change`` (a touched file) rewritten if
given; then ``register()``.  ``each_file``: the same copy, the gate's answer
unchanged, then with each touched file changed in turn (the error's text,
or None where it admitted the copy).  ``gone``: upstream's ``module`` loses
``name`` (a patch release renamed it) before ``register()``; then the
outcome, each patch's status, and real ``EngineArgs.create_engine_config``
for a stock configuration, upstream's ``OffloadingConnector`` on the CPU,
and the same with the overlay's pool tier as a secondary tier.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))

from vllm_overlay.testing import cpu_defaults, tiny_model_path  # noqa: E402


def attempt(fn) -> dict:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def _copy_touched() -> pathlib.Path:
    """The installed touched files, copied under a new ``vllm`` folder."""
    from vllm_overlay import version_gate

    installed = version_gate.installed_vllm_dir()
    copy = pathlib.Path(tempfile.mkdtemp()) / "vllm"
    for rel in version_gate.release_record("v0_32")["touched"]:
        target = copy.parent / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed.parent / rel, target)
    return copy


def each_file(config: dict, result: dict) -> None:
    from vllm_overlay import version_gate

    copy = _copy_touched()
    version_gate.installed_vllm_dir = lambda: copy
    gate = version_gate.check_installed_release
    result["unchanged"] = gate("0.32.x", config["version"])
    result["refusals"] = {}
    for rel in version_gate.release_record("v0_32")["touched"]:
        path = copy.parent / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n# changed by a patch release\n")
        outcome = attempt(lambda: gate("0.32.x", config["version"]))
        path.write_bytes(original)
        result["refusals"][rel] = outcome.get("message")
    result["after"] = gate("0.32.x", config["version"])
    shutil.rmtree(copy.parent)


def release(config: dict, result: dict) -> None:
    import vllm

    from vllm_overlay import version_gate

    vllm.__version__ = config["version"]
    copy = _copy_touched()
    if config.get("change"):
        path = copy.parent / config["change"]
        path.write_text(path.read_text() + "\n# changed by a patch release\n")
    version_gate.installed_vllm_dir = lambda: copy
    import vllm_overlay

    result["register"] = attempt(lambda: result.update(outcome=vllm_overlay.register()))
    shutil.rmtree(copy.parent)


def gone(config: dict, result: dict) -> None:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    module = importlib.import_module(config["module"])
    delattr(module, config["name"])
    import vllm_overlay
    from vllm_overlay.core.patching import REGISTRY

    result["outcome"] = vllm_overlay.register()

    def build(**extra):
        kv = None
        if extra:
            kv = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            )
        return lambda: EngineArgs(
            model=tiny_model_path(),
            max_model_len=256,
            enforce_eager=True,
            kv_transfer_config=kv,
        ).create_engine_config()

    result["stock"] = attempt(build())
    result["offloading"] = attempt(build(cpu_bytes_to_use=1 << 24))
    tier = {
        "type": "SharedPoolTier",
        "module_path": "vllm_overlay.integration.v0_32.pool_tier",
        "url": "redis://127.0.0.1:1",
    }
    result["pool_tier"] = attempt(
        build(
            spec_name="TieringOffloadingSpec",
            cpu_bytes_to_use=1 << 24,
            secondary_tiers=[tier],
        )
    )
    result["outcome_after"] = vllm_overlay.register()
    result["patches"] = {s.patch.id: s.status for s in REGISTRY.states()}


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result: dict = {}
    {"release": release, "gone": gone, "each_file": each_file}[config["case"]](
        config, result
    )
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
