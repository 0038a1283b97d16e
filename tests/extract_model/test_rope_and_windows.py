"""RoPE and sliding-window settings are read exactly as transformers 5 reads them, or refused naming the field.

Two kinds of check. Config level: for each config.json variant, transformers' own reading (AutoConfig, then its
rotary embedding's inverse frequencies and attention scaling, and its per-layer windows) against ours. Model level:
hidden states against transformers' PyTorch model loaded with `from_pretrained` from the same directory.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from extract.config import ModelConfig
from extract.errors import BadInput
from tests.extract_model.conftest import TinyModel, write_tiny_model
from tests.extract_model.test_numerics import FLOAT32_ATOL, compare_float32, one_device_engine

BASE = {
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 256,
}  # fmt: skip
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def transformers_reading(tmp_path: pathlib.Path, config: dict):
    """transformers' RoPE (inverse frequencies, attention scaling) and windows (per layer) for a config.json."""
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    rotary = Qwen2RotaryEmbedding(hf)
    windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    return rotary.inv_freq.numpy(), rotary.attention_scaling, windows, hf


# -- RoPE ------------------------------------------------------------------------------------------------------

HONOURED = {
    "nothing-given": {},
    "v4-theta": {"rope_theta": 1000000.0},
    "v5-default": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "v5-without-theta-takes-the-top-level-one": {"rope_theta": 5000.0, "rope_parameters": {"rope_type": "default"}},
    "empty-rope-scaling-leaves-rope-parameters": {"rope_scaling": {}, "rope_parameters": {"rope_theta": 70.0}},
    "v4-yarn": {"rope_theta": 1000000.0, "rope_scaling": YARN},
    "v4-yarn-default-original-length": {"rope_theta": 1000000.0, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    "v4-yarn-top-level-original-length-wins": {
        "rope_theta": 1000000.0, "original_max_position_embeddings": 32, "rope_scaling": YARN,
    },
    "v5-yarn-with-every-knob": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
    }},
    "v5-yarn-explicit-attention-factor": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 1.5,
    }},
    "v5-yarn-null-factor-is-the-length-ratio": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 64,
    }},
    "rope_type-wins-over-type": {"rope_scaling": {"rope_type": "linear", "type": "yarn", "factor": 2.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 100.0}},
    "llama3": {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0,
    }},
    # LongRoPE at lengths within its original context: the short factors, and the attention factor from the lengths.
    "longrope": {"rope_parameters": {
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2, 3, 4, 5, 6, 7], "long_factor": [9.0] * 8,
        "original_max_position_embeddings": 64}},
    "longrope-explicit-factor-and-top-level-original-length": {
        "original_max_position_embeddings": 32, "rope_scaling": {
            "type": "longrope", "short_factor": [1.0] * 7 + [2.0], "long_factor": [9.0] * 8, "factor": 3.0,
            "original_max_position_embeddings": 128}},
}  # fmt: skip


@pytest.mark.parametrize("case", list(HONOURED))
def test_rope_settings_resolve_to_transformers_frequencies_and_scaling(case, tmp_path):
    config = {**BASE, **HONOURED[case]}
    inverse, scaling, _, hf = transformers_reading(tmp_path, config)
    rope = ModelConfig.from_dict(config).rope
    assert rope.rope_type == hf.rope_parameters["rope_type"]
    np.testing.assert_allclose(rope.inverse_frequency_array(), inverse, rtol=2e-7, atol=0)
    assert rope.attention_scaling == pytest.approx(scaling, rel=1e-12)


def test_longrope_is_honoured_only_up_to_its_original_context(tmp_path):
    """transformers switches to the long factors once a call's longest position passes the original context, so the
    frequencies are those of one regime only up to it: the limit the engine holds max_seq_len to."""
    for case, limit in (("longrope", 64), ("longrope-explicit-factor-and-top-level-original-length", 32)):
        config = ModelConfig.from_dict({**BASE, **HONOURED[case]})
        assert config.rope.max_positions == config.max_positions == limit
        assert config.rope.attention_scaling > 1.1
    assert ModelConfig.from_dict(BASE).max_positions is None


def test_scaled_rope_settings_really_change_the_frequencies(tmp_path):
    """The honoured cases are not all the default in disguise."""
    default, _, _, _ = transformers_reading(tmp_path, {**BASE, "rope_theta": 1000000.0})
    yarn = ModelConfig.from_dict({**BASE, **HONOURED["v4-yarn"]}).rope
    assert yarn.attention_scaling > 1.1 and not np.allclose(yarn.inverse_frequency_array(), default)


REFUSED = {
    # case: (the RoPE fields, text the BadInput must hold)
    "rope_scaling-beside-a-different-rope_parameters": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "rope_scaling": YARN},
        "rope_scaling=.* and rope_parameters=.* disagree",
    ),
    "dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling\.rope_type='dynamic'.*batch"),
    "longrope-factors-of-the-wrong-length": (
        {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8}},
        r"rope_parameters\.short_factor must list 8 positive numbers",
    ),
    "unknown-type": ({"rope_parameters": {"rope_type": "weird"}}, r"rope_type='weird'.*does not know it"),
    "partial-rotary-factor": ({"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    "per-layer-type-blocks": (
        {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type blocks .*full_attention"
    ),
    "yarn-without-factor": ({"rope_scaling": {"type": "yarn"}}, r"rope_scaling\.factor is missing"),
    "null-theta": ({"rope_theta": None}, "rope_theta=None must be a positive number"),
    "rope_parameters-not-an-object": ({"rope_parameters": [10000.0]}, "rope_parameters must be a JSON object"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_rope_settings_not_honoured_exactly_are_refused_naming_the_field(case):
    fields, needle = REFUSED[case]
    with pytest.raises(BadInput, match=needle):
        ModelConfig.from_dict({**BASE, **fields}, source="m/config.json")


def test_the_issue_config_is_yarn_at_theta_ten_thousand_in_transformers(tmp_path):
    """Why rope_scaling beside rope_parameters is refused: transformers keeps rope_scaling whole and drops
    rope_parameters' theta, which is not what the config's author meant, and not what we used to compute."""
    fields, _ = REFUSED["rope_scaling-beside-a-different-rope_parameters"]
    _, scaling, _, hf = transformers_reading(tmp_path, {**BASE, **fields})
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["rope_theta"] == 10000.0
    assert scaling > 1.1


def _resaved(model: TinyModel, **fields) -> TinyModel:
    """The checkpoint with its config.json's RoPE fields replaced, and transformers' model loaded from it."""
    from transformers import AutoModelForCausalLM

    path = model.path
    config = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config.pop(key, None)
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return TinyModel(path, reference, model.num_hidden_layers)


SCALED_MODELS = {
    "v4-yarn": {"rope_theta": 1000000.0, "rope_scaling": YARN},
    "v5-llama3": HONOURED["llama3"],
    "v5-linear": HONOURED["linear"],
}


@pytest.mark.parametrize("case", list(SCALED_MODELS))
def test_scaled_rope_hidden_states_match_transformers(case, tmp_path):
    model = _resaved(write_tiny_model(tmp_path, "qwen2", layers=2, seed=11), **SCALED_MODELS[case])
    assert model.torch_model.model.rotary_emb.rope_type != "default"
    engine = one_device_engine(model, [1, 2], batch_size=2)
    worst = compare_float32(engine, model, lengths=[30, 9], seed=11)
    assert max(worst.values()) <= FLOAT32_ATOL, worst


def test_yarn_on_qwen3_matches_transformers(tmp_path):
    model = _resaved(write_tiny_model(tmp_path, "qwen3", layers=2, head_dim=32, seed=12), **SCALED_MODELS["v4-yarn"])
    engine = one_device_engine(model, [2], batch_size=1)
    worst = compare_float32(engine, model, lengths=[25], seed=12)
    assert max(worst.values()) <= FLOAT32_ATOL, worst


# -- sliding windows --------------------------------------------------------------------------------------------

WINDOWS = {
    # transformers' defaults: max_window_layers 28, sliding_window 4096.
    "max_window_layers-absent-with-30-layers": {"num_hidden_layers": 30, "use_sliding_window": True,
                                                "sliding_window": 8},
    "sliding_window-absent-is-4096": {"use_sliding_window": True, "max_window_layers": 1},
    "sliding_window-null-means-no-window": {"use_sliding_window": True, "sliding_window": None,
                                            "max_window_layers": 1},
    "window-off-ignores-max_window_layers": {"use_sliding_window": False, "sliding_window": 8,
                                             "max_window_layers": 0},
    "an-unused-zero-window-is-harmless": {"use_sliding_window": True, "sliding_window": 0},
    "layer_types-choose-the-sliding-layers": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                                              "layer_types": ["sliding_attention", "full_attention", "attention"]},
}  # fmt: skip


@pytest.mark.parametrize("case", list(WINDOWS))
def test_sliding_windows_per_layer_are_transformers_ones(case, tmp_path):
    config = {**BASE, **WINDOWS[case]}
    _, _, windows, _ = transformers_reading(tmp_path, config)
    assert ModelConfig.from_dict(config).sliding_windows == windows


WINDOWS_REFUSED = {
    "layer_types-slide-while-the-window-is-off": (
        {"use_sliding_window": False, "sliding_window": 8,
         "layer_types": ["full_attention", "sliding_attention", "full_attention"]},  # fmt: skip
        "layer_types marks layer 1 'sliding_attention' but use_sliding_window is not true",
    ),
    "layer_types-slide-while-the-window-is-null": (
        {"use_sliding_window": True, "sliding_window": None, "layer_types": ["sliding_attention"] * 3},
        "layer_types marks layer 0 'sliding_attention' but sliding_window is null",
    ),
    "zero-window": ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 1},
                    "sliding_window=0 is not a positive integer"),
    "layer_types-too-short": ({"layer_types": ["full_attention"] * 2}, "once per layer"),
    "layer_types-unknown": ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
                            "layer_types holds chunked_attention"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WINDOWS_REFUSED))
def test_window_settings_transformers_cannot_run_are_refused_naming_the_field(case, tmp_path):
    fields, needle = WINDOWS_REFUSED[case]
    config = {**BASE, **fields}
    with pytest.raises(BadInput, match=needle):
        ModelConfig.from_dict(config)
    # transformers itself fails on each of these, when reading the config or running the model.
    from transformers import Qwen2ForCausalLM

    with pytest.raises(Exception):  # noqa: B017 - what transformers raises differs by case; that it fails is the point
        _, _, _, hf = transformers_reading(tmp_path, config)
        hf._attn_implementation = "eager"
        Qwen2ForCausalLM(hf)(torch.tensor([list(range(1, 10))]))
