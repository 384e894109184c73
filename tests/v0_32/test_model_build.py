"""The repo's model builders under vLLM 0.32's transformers (5.x): the
tokenizer they write names a class transformers 4 (vLLM 0.11.2's) loads
too, so a model folder built by either harness serves on both releases
(the serving benchmark's (e) runs 0.11.2 nodes on the folder the 0.32
interpreter built; transformers 5 alone writes "TokenizersBackend")."""

from __future__ import annotations

import json

import transformers


def test_the_tokenizer_config_names_a_class_both_transformers_load(tmp_path):
    from transformers import AutoTokenizer

    from vllm_overlay.models.build_tiny_llama import build_tokenizer

    assert int(transformers.__version__.split(".")[0]) >= 5
    built = build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "the pool holds 1234 blocks"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
