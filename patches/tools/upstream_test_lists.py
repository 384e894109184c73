"""What run_upstream_tests_032.py runs of each vLLM release's own tests.

``RELEASES`` maps a version (``--version``) to its ``Release``: the paths
run (``select``), the paths and single tests left out, each with why
(``deselect``, ``deselect_tests``: they fail or hang alike in both runs),
the harness whose python runs them (``venv_env``, else ``venv`` under the
repository) and the environment that harness needs (``env``, a default a
caller's own value overrides).  Why each is left out: the runner's module
doc.
"""

from __future__ import annotations

from typing import NamedTuple


class Release(NamedTuple):
    select: list[str]
    deselect: dict[str, str]
    deselect_tests: dict[str, str]
    venv_env: str
    venv: str
    env: dict[str, str]


# the tests of the modules the patch sets patch or plug into
SELECT = [
    "tests/v1/kv_offload",
    "tests/v1/kv_connector/unit/offloading_connector",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
    "tests/engine/test_arg_utils.py",
]
SPAWNED = (
    "the region is exercised in spawned processes, which load no vLLM "
    "plugin (the overlay cannot change them) and take about 60 s together"
)
WEIGHTS = (
    "an engine (LLM()) on meta-llama/Llama-3.2-1B-Instruct's weights, which "
    "the offline runs do not have"
)
NO_C_EXTENSION = (
    "an engine (LLM()) with the OffloadingConnector on CPU: stock, it calls "
    "vllm._C's init_cpu_memory_env (the 0.33 harness is a Python-only "
    "build, no compiled extensions); the overlay refuses the connector on "
    "the CPU platform of 0.33 earlier, at create_engine_config"
)
CONNECTOR = "tests/v1/kv_connector/unit/test_offloading_connector.py::"
SHARED_REGION = "tests/v1/kv_offload/cpu/test_shared_offload_region.py::"

# paths under SELECT left out -> why
DESELECT_032 = {
    "tests/v1/kv_offload/cpu/test_gpu_worker.py": "CUDA streams and copies",
    "tests/v1/kv_offload/cpu/test_swap_blocks_batch.py": "a CUDA kernel",
    "tests/v1/kv_offload/cpu/test_swap_blocks_triton.py": "a Triton GPU kernel",
    "tests/v1/kv_offload/tiering/p2p": "peer-to-peer transport (ZMQ, NIXL)",
    "tests/v1/kv_offload/tiering/test_obj_tier.py": "the object store over NIXL",
}
# single tests left out -> why
DESELECT_TESTS_032 = {
    SHARED_REGION + "test_mp_barrier_unlinks_file_and_survives_sigkill": SPAWNED,
    SHARED_REGION + "test_multiprocess_race_construct_and_write": SPAWNED,
    SHARED_REGION + "test_create_next_worker_view_multiprocess_slots": SPAWNED,
    CONNECTOR + "test_tiering_offloading": WEIGHTS,
    CONNECTOR + "test_fs_tiering_offloading": WEIGHTS,
}
DESELECT_TESTS_033 = {
    **DESELECT_TESTS_032,
    CONNECTOR
    + "test_tiering_cache_reset_resumes_promotions_on_idle_engine": NO_C_EXTENSION,
}

RELEASES = {
    "0.32.0": Release(
        SELECT, DESELECT_032, DESELECT_TESTS_032, "OVERLAY_VENV_0_32", ".venv-0.32", {}
    ),
    # no CPU build: without VLLM_TARGET_DEVICE=cpu vLLM infers no platform
    "0.33.0": Release(
        SELECT,
        DESELECT_032,
        DESELECT_TESTS_033,
        "OVERLAY_VENV_0_33",
        ".venv-0.33",
        {"VLLM_TARGET_DEVICE": "cpu"},
    ),
}
