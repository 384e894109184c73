"""vLLM 0.32 with the overlay: what ``register()`` did, and the startup
error for each overlay feature that runs on 0.11.2 only (its connectors,
its offloading spec), and ``--enable-pp-prop-kv-cache`` on the command line
(which runs on 0.32 too), printed as JSON.

    python run_refusals.py '{}'
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))

from vllm_overlay.testing import cpu_defaults, tiny_model_path  # noqa: E402


def attempt(fn) -> dict:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    def llm(**kwargs):
        return lambda: LLM(
            model=tiny_model_path(), max_model_len=256, enforce_eager=True, **kwargs
        )

    def kv(name: str, **extra):
        return KVTransferConfig(kv_connector=name, kv_role="kv_both", **extra)

    cases = {
        "pool": llm(kv_transfer_config=kv("SharedKVPoolConnector")),
        "offload_connector": llm(kv_transfer_config=kv("OverlayOffloadingConnector")),
        "offload_spec": llm(
            kv_transfer_config=kv(
                "OffloadingConnector",
                kv_connector_extra_config={"spec_name": "OverlayCPUOffloadingSpec"},
            )
        ),
        "module_path": llm(
            kv_transfer_config=kv(
                "SharedKVPoolConnector2",
                kv_connector_module_path="vllm_overlay.connectors.shared_pool",
            )
        ),
    }
    result = {name: attempt(fn) for name, fn in cases.items()}

    def cli_flag():
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
        parser.parse_args(["--enable-pp-prop-kv-cache"])

    result["cli_flag"] = attempt(cli_flag)
    import vllm_overlay
    from vllm_overlay.core.patching import REGISTRY

    result["outcome"] = vllm_overlay.register()
    result["patches"] = {s.patch.id: s.status for s in REGISTRY.states()}
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
