"""Every family's config.json is read exactly as transformers reads it, or refused naming the field.

The reference is transformers itself: `AutoConfig.from_pretrained` on the same config.json, then the model it builds
(`AutoModelForCausalLM.from_config`, run on a few tokens so that a config it cannot run fails here too), read back
from its modules: head_dim, the softmax scale, the soft-cap, each layer's window and RoPE (inverse frequencies and
attention scaling), biases, q/k norms and the MLP's activation. Small spaces are covered exhaustively (every
combination of absent / null / given for the fields whose defaults differ between families); the rest by cases.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from extract.config import DEFAULTS, ModelConfig
from extract.errors import BadInput
from extract.model import ACTIVATIONS

#: Small sizes. num_key_value_heads is given (2) except where a test leaves it out on purpose: the default of
#: Qwen (32) and Mistral (8) does not divide 4 query heads.
SIZES = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 64, "max_position_embeddings": 256}  # fmt: skip
CONFIG_CLASSES = {
    "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig", "mistral": "MistralConfig",
    "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
}  # fmt: skip


def test_the_defaults_table_is_transformers_config_classes_defaults():
    import transformers

    for model_type, class_name in CONFIG_CLASSES.items():
        fields = {f.name: f.default for f in dataclasses.fields(getattr(transformers, class_name))}
        for name, ours in DEFAULTS[model_type].items():
            assert fields[name] == ours, (model_type, name, fields[name], ours)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a config means for the forward pass, as comparable values."""

    num_key_value_heads: int
    head_dim: int
    query_scale: float
    softcap: float | None
    windows: tuple[int | None, ...]
    ropes: tuple[tuple[tuple[float, ...], float], ...]  # per layer: inverse frequencies, attention scaling
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    activation: tuple[float, ...]  # the gate activation at a few points


_POINTS = np.linspace(-4, 4, 17, dtype=np.float32)


def transformers_reading(tmp_path: pathlib.Path, config: dict) -> Reading:
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).eval()
    with torch.inference_mode():
        model(torch.tensor([list(range(1, 9))]))  # a config transformers cannot run fails here
    rotary = model.model.rotary_emb
    windows, ropes = [], []
    for block in model.model.layers:
        attention = block.self_attn
        layer_type = getattr(attention, "layer_type", None)
        if hasattr(rotary, f"{layer_type}_inv_freq"):  # one RoPE per layer type (Gemma 3)
            ropes.append((getattr(rotary, f"{layer_type}_inv_freq"), getattr(rotary, f"{layer_type}_attention_scaling")))
        else:
            ropes.append((rotary.inv_freq, rotary.attention_scaling))
        # Mistral's attention passes the config's window to every layer; the others keep their layer's.
        windows.append(hf.sliding_window if hf.model_type == "mistral" else getattr(attention, "sliding_window", None))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with torch.inference_mode():
        activation = mlp.act_fn(torch.from_numpy(_POINTS)).numpy()
    return Reading(
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=attention.head_dim,
        query_scale=attention.scaling,
        # Gemma 3's attention keeps attn_logit_softcapping but never passes it to the kernel (modeling_gemma3.py).
        softcap=attention.attn_logit_softcapping if hf.model_type == "gemma2" else None,
        windows=tuple(windows),
        ropes=tuple((tuple(inv.numpy().astype(float)), float(scaling)) for inv, scaling in ropes),
        qkv_bias=attention.q_proj.bias is not None,
        o_bias=attention.o_proj.bias is not None,
        qk_norm=hasattr(attention, "q_norm"),
        activation=tuple(activation.astype(float)),
    )


def our_reading(config: dict) -> Reading:
    ours = ModelConfig.from_dict(config)
    ropes = [ours.layer_rope(i) for i in range(ours.num_hidden_layers)]
    return Reading(
        num_key_value_heads=ours.num_key_value_heads,
        head_dim=ours.head_dim,
        query_scale=ours.query_scale,
        softcap=ours.attention_softcap,
        windows=ours.sliding_windows,
        ropes=tuple((tuple(r.inverse_frequency_array().astype(float)), r.attention_scaling) for r in ropes),
        qkv_bias=ours.qkv_bias,
        o_bias=ours.o_bias,
        qk_norm=ours.qk_norm,
        activation=tuple(np.asarray(ACTIVATIONS[ours.activation](jnp.asarray(_POINTS))).astype(float)),
    )


def assert_same_reading(ours: Reading, theirs: Reading) -> None:
    for field in dataclasses.fields(Reading):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if field.name == "ropes":
            for (inv_a, scale_a), (inv_b, scale_b) in zip(a, b, strict=True):
                np.testing.assert_allclose(inv_a, inv_b, rtol=2e-7, atol=0)
                assert scale_a == pytest.approx(scale_b, rel=1e-12)
        elif field.name in ("activation", "query_scale"):  # the same formula, rounded differently
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=field.name)
        else:
            assert a == b, (field.name, a, b)


def transformers_refuses(tmp_path: pathlib.Path, config: dict) -> bool:
    try:
        transformers_reading(tmp_path, config)
    except Exception:  # noqa: BLE001 - what transformers raises differs by case; that it fails is the point
        return True
    return False


# -- exhaustive over the fields whose defaults differ between families -------------------------------------------

ABSENT = object()
#: Each field: absent, null, or a value (kv heads 1: divides the 4 query heads, unlike some families' defaults).
STATES = {"num_key_value_heads": (ABSENT, None, 1), "head_dim": (ABSENT, None, 32), "sliding_window": (ABSENT, None, 3)}
FAMILY_EXTRAS = {
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1},  # so that sliding_window matters
    "qwen3": {"use_sliding_window": True, "max_window_layers": 1},
    "llama": {}, "mistral": {}, "gemma2": {}, "gemma3_text": {"sliding_window_pattern": 2},
}  # fmt: skip
COMBINATIONS = [
    (model_type, dict(zip(STATES, states)))
    for model_type in CONFIG_CLASSES
    for states in itertools.product(*STATES.values())
]


@pytest.mark.parametrize(
    "model_type, states", COMBINATIONS,
    ids=[f"{t}-" + "-".join("absent" if v is ABSENT else str(v) for v in s.values()) for t, s in COMBINATIONS],
)  # fmt: skip
def test_defaults_and_nulls_read_as_transformers_reads_them_or_both_refuse(model_type, states, tmp_path):
    config = {"model_type": model_type, **SIZES, **FAMILY_EXTRAS[model_type]}
    for name, value in states.items():
        if value is ABSENT:
            config.pop(name, None)
        else:
            config[name] = value
    try:
        ours = our_reading(config)
    except BadInput as refusal:
        assert transformers_refuses(tmp_path, config), f"we refuse what transformers runs: {refusal}"
        return
    assert_same_reading(ours, transformers_reading(tmp_path, config))


# -- the four mismatches of issue 30, each against transformers ----------------------------------------------------


def test_qwen3_without_head_dim_has_transformers_default_of_128_not_hidden_over_heads(tmp_path):
    config = {"model_type": "qwen3", **SIZES}
    assert "head_dim" not in config
    assert ModelConfig.from_dict(config).head_dim == 128 == transformers_reading(tmp_path, config).head_dim


@pytest.mark.parametrize("value", ["true", 1, "false", 0])
def test_use_sliding_window_that_is_not_a_bool_is_refused_as_transformers_refuses_it(value, tmp_path):
    config = {"model_type": "qwen2", **SIZES, "use_sliding_window": value, "sliding_window": 4, "max_window_layers": 0}
    with pytest.raises(BadInput, match=rf"use_sliding_window={value!r} must be true or false"):
        ModelConfig.from_dict(config)
    assert transformers_refuses(tmp_path, config)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_a_null_num_key_value_heads_is_num_attention_heads_as_in_transformers(model_type, tmp_path):
    config = {"model_type": model_type, **SIZES, "num_key_value_heads": None}
    assert ModelConfig.from_dict(config).num_key_value_heads == 4
    assert transformers_reading(tmp_path, config).num_key_value_heads == 4


# -- cases -------------------------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
HONOURED = {
    "llama-2": ("llama", {"num_key_value_heads": 4, "rope_theta": 10000.0, "rope_scaling": None}),
    "llama-3.1-v4-spelling": ("llama", {"num_key_value_heads": 2, "rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    "llama-3.2-v5-spelling": ("llama", {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "head_dim": 8}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),
    "mistral-v0.1": ("mistral", {"sliding_window": 4, "rope_theta": 10000.0}),
    "mistral-v0.3-no-window": ("mistral", {"sliding_window": None, "rope_theta": 1000000.0}),
    "gemma2-2b-like": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0}),
    "gemma2-9b-like-query-scalar": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 36}),
    "gemma2-no-softcap": ("gemma2", {"head_dim": 16, "attn_logit_softcapping": None}),
    "gemma2-layer_types": ("gemma2", {"head_dim": 16, "sliding_window": 4,
                                      "layer_types": ["full_attention", "attention", "sliding_attention"]}),
    "gemma2-attention-bias": ("gemma2", {"head_dim": 16, "attention_bias": True}),
    "gemma2-gelu-new": ("gemma2", {"head_dim": 16, "hidden_activation": "gelu_new"}),
    "gemma3-1b-like": ("gemma3_text", {"head_dim": 16, "sliding_window": 4, "rope_theta": 1000000.0,
                                       "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2}),
    "gemma3-4b-like-linear-global": ("gemma3_text", {"head_dim": 16, "sliding_window_pattern": 3,
                                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "gemma3-v5-blocks": ("gemma3_text", {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"] + [
        "sliding_attention"], "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 700.0}}}),
    "gemma3-softcap-read-but-unused": ("gemma3_text", {"head_dim": 16, "attn_logit_softcapping": 5.0}),
    "gemma3-qk-norm-and-bias": ("gemma3_text", {"head_dim": 16, "attention_bias": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HONOURED))
def test_family_settings_read_as_transformers_reads_them(case, tmp_path):
    model_type, fields = HONOURED[case]
    config = {"model_type": model_type, **SIZES, **fields}
    assert_same_reading(our_reading(config), transformers_reading(tmp_path, config))


#: Refused although transformers runs them: each message says why.
REFUSED = {
    "llama-mlp-bias": ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    "mistral-layer_types-ignored-by-transformers": (
        "mistral", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
        "MistralModel ignores it and slides every layer"),
    "gemma2-bidirectional": ("gemma2", {"use_bidirectional_attention": True},
                             "use_bidirectional_attention=True is not supported"),
    "gemma3-flat-rope_parameters-ignored-by-transformers": (
        "gemma3_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}},
        "rope_parameters holds rope_theta, rope_type"),
    "gemma3-multimodal": ("gemma3", {}, "model_type='gemma3' is not supported .*gemma3_text"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_transformers_would_read_against_the_authors_intent_are_refused_naming_the_field(case):
    model_type, fields, needle = REFUSED[case]
    with pytest.raises(BadInput, match=needle):
        ModelConfig.from_dict({"model_type": model_type, **SIZES, **fields})


#: Refused because transformers fails on them too.
FAILING = {
    "llama-hidden-not-divisible-by-heads": ("llama", {"hidden_size": 66, "head_dim": 16}, "hidden_size=66"),
    "gemma2-null-window-on-sliding-layers": ("gemma2", {"sliding_window": None}, "sliding_window is null"),
    "gemma3-zero-pattern": ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern=0"),
    "gemma2-float-query-scalar": ("gemma2", {"query_pre_attn_scalar": 16.0}, "query_pre_attn_scalar=16.0"),
    "mistral-zero-window": ("mistral", {"sliding_window": 0}, "sliding_window=0"),
    "gemma3-rope_scaling-without-full-block": (
        "gemma3_text", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                        "rope_parameters": {"sliding_attention": {"rope_type": "default"}}},
        "no full_attention block"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FAILING))
def test_settings_transformers_fails_on_are_refused_naming_the_field(case, tmp_path):
    model_type, fields, needle = FAILING[case]
    config = {"model_type": model_type, **SIZES, **fields}
    with pytest.raises(BadInput, match=needle):
        ModelConfig.from_dict(config)
    assert transformers_refuses(tmp_path, config)
