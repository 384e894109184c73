"""The pool's identity in parts (``integration/v0_32/kv_identity``,
``worker_identity``), on vLLM 0.32's own configs: what decides the bytes
counts, where the model was loaded from does not.

The engine-level halves are in ``test_pool_weights_cpu`` (weights changed
in a running engine) and ``test_page_layout_cpu`` (real kernels)."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

from vllm_overlay.integration.v0_32 import kv_identity
from vllm_overlay.integration.v0_32.worker_identity import (
    device_digest,
    weights_digest,
)
from vllm_overlay.testing import tiny_model_path


def factors(model: str, **args) -> list[str]:
    config = EngineArgs(
        model=model, dtype=args.pop("dtype", "float32"), max_model_len=512, **args
    ).create_engine_config()
    return kv_identity.config_factors(config)


@pytest.fixture(scope="module")
def mounts(tmp_path_factory):
    """The tiny Llama's folder, a symlink to it and a copy elsewhere."""
    root = tmp_path_factory.mktemp("mounts")
    link = root / "link"
    link.symlink_to(tiny_model_path())
    copy = root / "copy"
    shutil.copytree(tiny_model_path(), copy)
    return pathlib.Path(tiny_model_path()), link, copy


def test_the_models_location_is_not_in_the_identity(mounts):
    """Same bytes, three paths: one identity (vLLM's own hash differs)."""
    real, link, copy = mounts
    assert factors(str(real)) == factors(str(link)) == factors(str(copy))
    hashes = {
        EngineArgs(model=str(p), dtype="float32", max_model_len=512)
        .create_engine_config()
        .model_config.compute_hash()
        for p in mounts
    }
    assert len(hashes) == 3  # what the identity had before: no sharing


def test_what_changes_the_bytes_changes_the_identity(mounts):
    real, _, copy = mounts
    base = factors(str(real))
    assert factors(str(real), dtype="bfloat16") != base
    assert factors(str(real), block_size=64) != base  # the cache config's hash
    config = copy / "config.json"
    config.write_text(
        config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
    )
    assert '"rms_norm_eps": 1e-05' in config.read_text()
    assert factors(str(copy)) != base
    assert "format=vllm-0.32/chunks-1" in base


def test_the_weights_digest_sees_every_byte():
    model = torch.nn.Linear(8, 4)
    before = weights_digest(model)
    assert weights_digest(model) == before
    with torch.no_grad():
        model.weight[3, 7] = torch.nextafter(model.weight[3, 7], torch.tensor(2.0))
    assert weights_digest(model) != before
    model.register_buffer("scale", torch.ones(2))
    assert weights_digest(model) not in (before,)


def test_the_device_digest_sees_every_word():
    """The GPU path (two sums on the device), run here on host tensors: any
    one changed word, and any two words swapped, change it."""
    t = torch.arange(1000, dtype=torch.float32)
    base = device_digest(t)
    for i in (0, 511, 999):
        u = t.clone()
        u[i] = -1.0
        assert device_digest(u) != base
    swapped = t.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert device_digest(swapped) != base
    assert device_digest(t.clone()) == base
    assert device_digest(t.to(torch.bfloat16)) != base


class Tier:
    def __init__(self) -> None:
        self.keys: list = []

    def rekey(self, engine_factors) -> None:
        self.keys.append(engine_factors)


def test_a_changed_measurement_rekeys_the_engines_tiers_only():
    first = kv_identity.engine("engine-a")
    other = kv_identity.engine("engine-b")
    tier, bystander = Tier(), Tier()
    assert first.factors() == []  # not measured yet: a tier refuses
    assert first.update("w1", "p") is True
    first.subscribe(tier)
    other.subscribe(bystander)
    assert first.update("w1", "p") is False and tier.keys == []
    assert first.update("w2", "p") is True
    assert tier.keys == [["weights=w2", "pages=p"]] and bystander.keys == []
    assert kv_identity.engine("engine-a") is first


@pytest.mark.parametrize(
    "transfer, measured",
    [
        (None, False),
        ({"kv_connector_extra_config": {}}, False),
        ({"kv_connector_extra_config": {"secondary_tiers": [{"type": "x"}]}}, True),
        (
            {
                "kv_connector_extra_config": {
                    "connectors": [
                        {"kv_connector_extra_config": {}},
                        {"kv_connector_extra_config": {"secondary_tiers": [{}]}},
                    ]
                }
            },
            True,
        ),
    ],
)
def test_measured_only_with_secondary_tiers(transfer, measured):
    assert kv_identity._secondary_tiers(transfer) is measured


def test_a_measurement_that_fails_after_start_up_isolates_the_engine():
    """Weights that cannot be named after an RPC: the engine's tiers move to
    a namespace of their own (shared with no node), logged; at start-up
    the failure is the engine's start-up error."""
    import types

    answers = [[{"weights": "w1", "pages": ["p"]}], RuntimeError("worker died")]

    def collective_rpc(fn):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    transfer = types.SimpleNamespace(
        kv_connector_extra_config={"secondary_tiers": [{}]}, engine_id="engine-f"
    )
    core = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(kv_transfer_config=transfer),
        model_executor=types.SimpleNamespace(collective_rpc=collective_rpc),
    )
    kv_identity.measure(core)
    identity = kv_identity.engine("engine-f")
    tier = Tier()
    identity.subscribe(tier)
    weights = identity.weights
    kv_identity.measure(core)
    assert identity.weights.startswith("unmeasured-") and identity.weights != weights
    assert tier.keys == [[f"weights={identity.weights}", f"pages={identity.pages}"]]

    fresh = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(
                kv_connector_extra_config={"secondary_tiers": [{}]},
                engine_id="engine-g",
            )
        ),
        model_executor=types.SimpleNamespace(
            collective_rpc=lambda fn: (_ for _ in ()).throw(RuntimeError("no"))
        ),
    )
    with pytest.raises(RuntimeError, match="no"):
        kv_identity.measure(fresh)
