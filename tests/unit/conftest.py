import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def overlay():
    """The overlay registered in this process (as vLLM's plugin loader does)."""
    import vllm_overlay

    assert vllm_overlay.register() == "applied"
    return vllm_overlay
