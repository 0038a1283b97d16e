"""The generated stand-ins are real formats: transformers loads the checkpoint; the parquet has FineWeb-Edu columns."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from extract.tiny import FINEWEB_COLUMNS


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_transformers_loads_the_tiny_checkpoint_with_every_weight(tiny_models, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(str(tiny_models[model_type]), output_loading_info=True)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if model_type == "qwen2" else "Qwen3ForCausalLM")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((tiny_models[model_type] / "config.json").read_text())
    assert model.config.hidden_size == config["hidden_size"]
    assert model.config.tie_word_embeddings == config["tie_word_embeddings"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models[model_type]))
    assert len(tokenizer) <= config["vocab_size"]
    # Qwen-style: the tokenizer adds no BOS/EOS of its own.
    assert tokenizer("The students")["input_ids"] == tokenizer("The students", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(tokenizer("über 学习 café")["input_ids"]) == "über 学习 café"


def test_parquet_has_fineweb_columns_and_mixed_lengths(corpus):
    table = pq.read_table(corpus.files[0])
    assert tuple(table.column_names) == FINEWEB_COLUMNS
    texts = table.column("text").to_pylist()
    assert "" in texts, "empty documents must be exercised"
    assert max(len(t.split()) for t in texts) > 300, "over-long documents must be exercised"
    assert pq.ParquetFile(corpus.files[0]).metadata.num_row_groups > 1
