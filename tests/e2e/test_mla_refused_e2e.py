"""DeepSeek's MLA on vLLM 0.11.2's CPU platform: there is no MLA attention
backend, so the engine does not start.  ``CpuPlatform.get_attn_backend_cls``
raises for any MLA model, whatever the dtype, block size or
``VLLM_ATTENTION_BACKEND``.  The pool connector's MLA path is covered by the
unit round trip (tests/unit/test_pool.py,
``test_mla_cross_layer_blocks_round_trip_through_the_pool``), and MLA runs
end to end on vLLM 0.32 (tests/v0_32/test_mla_cpu.py).  If a 0.11.x build
starts to run it, this test fails, and the e2e tests should follow."""

from __future__ import annotations

import pytest
from conftest import LLMRun


def test_vllm_0_11_2_has_no_mla_backend_on_cpu():
    with pytest.raises(AssertionError) as failed:
        LLMRun({}, {}, "run_mla.py")
    assert "NotImplementedError: MLA is not supported on CPU." in str(failed.value)
