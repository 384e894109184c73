"""vLLM 0.32 with ``VLLM_OVERLAY_SKIP_PATCHES`` from the environment: what
``register()`` did with the failed-transfer patches (OF32-04/05/06), and
real ``EngineArgs.create_engine_config`` (the front end) for a stock
configuration and for upstream's ``OffloadingConnector`` on the CPU,
printed as JSON.  For ``run_cases`` (no engine starts).

    VLLM_OVERLAY_SKIP_PATCHES=OF32-05 python run_failure_unit.py '{}'
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))

from vllm_overlay.testing import (  # noqa: E402
    cpu_defaults,
    in_process_engine,
    tiny_model_path,
)
from vllm_overlay.testing.v0_32 import offload_connector  # noqa: E402

UNIT = ("OF32-04", "OF32-05", "OF32-06")


def attempt(fn) -> dict:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine(rpc=False)
    from vllm.engine.arg_utils import EngineArgs

    import vllm_overlay
    from vllm_overlay.core.patching import REGISTRY

    result = {"outcome": vllm_overlay.register()}

    def build(kv):
        return lambda: EngineArgs(
            model=tiny_model_path(),
            max_model_len=256,
            enforce_eager=True,
            kv_transfer_config=kv,
        ).create_engine_config()

    result["stock"] = attempt(build(None))
    result["offloading"] = attempt(build(offload_connector()))
    result["patches"] = {
        pid: [REGISTRY.state(pid).status, REGISTRY.state(pid).detail] for pid in UNIT
    }
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
