"""vllm_overlay.testing: the copy model's path is explicit and its absence a
clear error; the tiny Llama's engine arguments take overrides."""

from __future__ import annotations

import pytest

from vllm_overlay.testing import common


def test_copy_model_from_the_checkout_or_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(common.COPY_MODEL_ENV, raising=False)
    assert common.copy_model_path().endswith("eval/model/copy_llama")
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv(common.COPY_MODEL_ENV, str(tmp_path))
    assert common.copy_model_path() == str(tmp_path)


def test_a_missing_copy_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(common.COPY_MODEL_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=common.COPY_MODEL_ENV):
        common.copy_model_path()
    monkeypatch.delenv(common.COPY_MODEL_ENV)
    monkeypatch.setattr(common, "_CHECKOUT_COPY_MODEL", tmp_path / "copy_llama")
    with pytest.raises(FileNotFoundError, match="not run from a source checkout"):
        common.copy_model_path()


def test_tiny_engine_args_take_overrides():
    args = common.tiny_engine_args(max_model_len=512, num_gpu_blocks_override=None)
    assert args["model"] == common.tiny_model_path()
    assert args["max_model_len"] == 512 and args["num_gpu_blocks_override"] is None
    assert args["dtype"] == "float32" and args["seed"] == 0 and args["enforce_eager"]
