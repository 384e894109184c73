"""The pool tier's locality and its back-pressure detector agree, under
upstream's own factory (``TieringOffloadingSpec.get_manager`` builds the
tier through ``SecondaryTierFactory``, which builds the detector first,
with defaults picked by the entry's ``locality``; vLLM 0.32, and 0.33 in
``tox -e v0_33``).

Before the fix an entry without ``locality`` gave a tier that reports
REMOTE the EMA detector's local-disk watermarks (0.010/0.002 s/MiB, not
0.050/0.010): back-pressure 5x too eager on a network pool."""

from __future__ import annotations

import pathlib
import sys

import pytest
from vllm.v1.kv_offload.base import Locality
from vllm.v1.kv_offload.tiering.backpressure import (
    EMABackpressureDetector,
    ThrottledDropPolicy,
)

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402
from support.tiering_manager import make_manager  # noqa: E402

EMA = EMABackpressureDetector
NETWORK = (EMA.NETWORK_HIGH_WATER_S, EMA.NETWORK_LOW_WATER_S)
LOCAL = (EMA.LOCAL_HIGH_WATER_S, EMA.LOCAL_LOW_WATER_S)


@pytest.fixture(scope="module")
def server():
    s = RedisServer()
    yield s
    s.close()


def built(server, backpressure: dict, **options):
    """(locality the tier reports, its detector's watermarks, detector)."""
    manager = make_manager(server.url, backpressure=backpressure, **options)
    try:
        tier = manager.secondary_tiers[0]
        detector = tier.bp_detector
        return tier.locality, (detector._high, detector._low), detector
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "options, locality, marks",
    [
        ({}, Locality.REMOTE, NETWORK),  # before the fix: LOCAL's marks
        ({"locality": "REMOTE"}, Locality.REMOTE, NETWORK),
        ({"locality": "remote"}, Locality.REMOTE, NETWORK),
        ({"locality": "LOCAL"}, Locality.LOCAL, LOCAL),
    ],
)
def test_the_detector_is_built_for_the_locality_the_tier_reports(
    server, options, locality, marks
):
    got = built(server, {"backpressure_cls": "EMABackpressureDetector"}, **options)
    assert got[:2] == (locality, marks)


def test_the_entrys_own_backpressure_keys_and_policy_are_kept(server):
    """Without ``locality``: the entry's own keys win over the defaults,
    the rest are REMOTE's, and the policy is the one the entry named."""
    config = {
        "backpressure_cls": "EMABackpressureDetector",
        "policy_cls": "DropStorePolicy",
        "low_water_s": 0.003,
        "alpha": 0.5,
    }
    locality, marks, detector = built(server, config)
    assert locality is Locality.REMOTE
    assert marks == (EMA.NETWORK_HIGH_WATER_S, 0.003)
    assert detector._alpha == 0.5
    assert type(detector.policy).__name__ == "DropStorePolicy"
    assert not isinstance(detector.policy, ThrottledDropPolicy)
