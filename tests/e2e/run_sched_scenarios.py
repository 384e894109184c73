"""The KV-pressure scheduler scenarios (tests/support/sched_scenarios.py) as
per-step traces; prints JSON.

    python run_sched_scenarios.py '{"connector": "OverlayOffloadingConnector"}'

Runs in whatever vLLM is first on the path, with vLLM's general plugins
loaded as an engine loads them (the overlay, unless VLLM_OVERLAY_DISABLE).
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from support import sched_scenarios  # noqa: E402


def main(config: dict) -> dict:
    import vllm
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    make = sched_scenarios.build(config.get("connector", "OverlayOffloadingConnector"))
    return {"vllm": vllm.__file__, "traces": sched_scenarios.scenarios(make)}


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
