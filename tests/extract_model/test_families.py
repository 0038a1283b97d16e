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

from extract.config import ModelConfig
from extract.families import DEFAULTS
from extract.errors import BadInput
from extract.model import ACTIVATIONS

#: Small sizes. num_key_value_heads is given (2) except where a test leaves it out on purpose: the default of
#: Qwen (32) and Mistral (8) does not divide 4 query heads. pad_token_id 0: Phi-3's default (32000) is outside the
#: vocabulary, which its embedding refuses.
SIZES = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 64, "max_position_embeddings": 256, "pad_token_id": 0}  # fmt: skip
CONFIG_CLASSES = {
    "gpt2": "GPT2Config", "gpt_neox": "GPTNeoXConfig", "llama": "LlamaConfig", "mistral": "MistralConfig",
    "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "phi3": "Phi3Config", "olmo2": "Olmo2Config",
    "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
    "gemma3": "Gemma3TextConfig",  # the multimodal config's text_config
    "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig",
}  # fmt: skip
#: A vision tower as small as Gemma 3's multimodal model accepts (never run: the inputs are text).
TINY_VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip


def config_of(model_type: str, fields: dict) -> dict:
    """config.json of `model_type` holding `fields`; a multimodal Gemma 3 holds them in its text_config."""
    if model_type == "gemma3":
        return {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", **fields},
                "vision_config": TINY_VISION, "mm_tokens_per_image": 4}  # fmt: skip
    return {"model_type": model_type, **fields}


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
    intermediate_size: int
    query_scale: float
    softcap: float | None
    windows: tuple[int | None, ...]
    ropes: tuple[tuple[tuple[float, ...], float], ...]  # per layer: inverse frequencies, attention scaling
    qkv_bias: bool
    o_bias: bool
    qk_norm: str | None  # "head" (per head) or "projection" (over all heads)
    norm_position: str
    norm_eps: float
    parallel_residual: bool
    mlp: str
    position_table: int
    activation: tuple[float, ...]  # the gate activation at a few points
    #: per layer, a mixture of experts' (experts, top k, expert width, renormalised, shared expert width, float32
    #: weights); None for a dense MLP.
    moe: tuple[tuple | None, ...] = ()


_POINTS = np.linspace(-4, 4, 17, dtype=np.float32)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' decoder inside a causal LM (or inside a multimodal Gemma 3)."""
    base = model.base_model
    return getattr(base, "language_model", base)


def block_parts(block: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.nn.Module]]:
    """A transformers decoder layer's attention, MLP and norms (by its own attribute names)."""
    attention = next(getattr(block, n) for n in ("self_attn", "attention", "attn") if hasattr(block, n))
    norms = {n: m for n, m in block.named_children() if "norm" in n or n.startswith("ln_")}
    return attention, block.mlp, norms


def transformers_reading(tmp_path: pathlib.Path, config: dict) -> Reading:
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).eval()
    with torch.inference_mode():
        model(torch.tensor([list(range(1, 9))]))  # a config transformers cannot run fails here
    text = getattr(hf, "text_config", hf)
    decoder = decoder_of(model)
    rotary = getattr(decoder, "rotary_emb", None)
    blocks = getattr(decoder, "layers", None) or decoder.h
    windows, ropes = [], []
    for block in blocks:
        attention, _, _ = block_parts(block)
        layer_type = getattr(attention, "layer_type", None)
        if hasattr(rotary, f"{layer_type}_inv_freq"):  # one RoPE per layer type (Gemma 3)
            ropes.append((getattr(rotary, f"{layer_type}_inv_freq"), getattr(rotary, f"{layer_type}_attention_scaling")))
        elif rotary is not None:
            ropes.append((rotary.inv_freq, rotary.attention_scaling))
        # Mistral's, Phi-3's, Mixtral's and OLMoE's attention pass the config's window to every layer; the others
        # keep their layer's.
        everywhere = text.model_type in ("mistral", "phi3", "mixtral", "olmoe")
        windows.append(getattr(text, "sliding_window", None) if everywhere else getattr(attention, "sliding_window", None))
    attention, mlp, norms = block_parts(blocks[0])
    moe = tuple(_their_moe(block.mlp, text) for block in blocks)
    gated = mlp.experts if hasattr(mlp, "experts") else mlp  # an expert's activation is the MLP's
    act = next(getattr(gated, n) for n in ("act_fn", "activation_fn", "act") if hasattr(gated, n))
    with torch.inference_mode():
        activation = act(torch.from_numpy(_POINTS)).numpy()
    q_norm = getattr(attention, "q_norm", None)
    biased = {n: getattr(attention, n).bias is not None for n in ("q_proj", "o_proj", "query_key_value", "dense",
                                                                  "qkv_proj", "c_attn", "c_proj") if hasattr(attention, n)}  # fmt: skip
    head_dim = next(getattr(attention, n) for n in ("head_dim", "head_size") if hasattr(attention, n))
    heads = text.num_attention_heads
    if hasattr(attention, "k_proj"):
        kv_heads = attention.k_proj.out_features // head_dim
    elif hasattr(attention, "qkv_proj"):  # Phi-3: [q; k; v]
        kv_heads = (attention.qkv_proj.out_features - heads * head_dim) // (2 * head_dim)
    else:  # GPT-2, NeoX: as many key/value heads as query heads
        kv_heads = heads
    return Reading(
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=mlp.down_proj.in_features if hasattr(mlp, "down_proj") else (
            mlp.dense_4h_to_h.in_features if hasattr(mlp, "dense_4h_to_h") else mlp.c_fc.nf) if not hasattr(
            mlp, "experts") else text.intermediate_size,  # a mixture's dense layers (Qwen-MoE) are this wide
        query_scale=attention.scaling,
        # Gemma 3's attention keeps attn_logit_softcapping but never passes it to the kernel (modeling_gemma3.py).
        softcap=attention.attn_logit_softcapping if text.model_type == "gemma2" else None,
        windows=tuple(windows),
        ropes=tuple((tuple(inv.numpy().astype(float)), float(scaling)) for inv, scaling in ropes),
        qkv_bias=any(biased.get(n, False) for n in ("q_proj", "query_key_value", "qkv_proj", "c_attn")),
        o_bias=any(biased.get(n, False) for n in ("o_proj", "dense", "c_proj")),
        qk_norm=None if q_norm is None else "head" if q_norm.weight.numel() == head_dim else "projection",
        # Where the layer's norms sit, by transformers' names: a post-attention norm without an input norm (OLMo 2)
        # is after; with a pre-feedforward norm (Gemma 2, 3) around; else before.
        norm_position="after" if "input_layernorm" not in norms and "ln_1" not in norms else (
            "around" if "pre_feedforward_layernorm" in norms else "before"),
        norm_eps=next(iter(norms.values())).eps if hasattr(next(iter(norms.values())), "eps") else next(
            iter(norms.values())).variance_epsilon,
        parallel_residual=bool(getattr(block, "use_parallel_residual", False)),
        mlp="gated" if hasattr(gated, "gate_proj") or hasattr(gated, "gate_up_proj") else "plain",
        position_table=decoder.wpe.num_embeddings if hasattr(decoder, "wpe") else 0,
        activation=tuple(activation.astype(float)),
        moe=moe,
    )  # fmt: skip


def _their_moe(mlp: torch.nn.Module, text) -> tuple | None:
    """A transformers layer's mixture, read from its modules: experts and their width from the stacked weights,
    top k and renormalisation from the router; Mixtral's router renormalises and keeps float32 weights always."""
    if not hasattr(mlp, "experts"):
        return None
    experts, width = mlp.experts.down_proj.shape[0], mlp.experts.down_proj.shape[2]
    mixtral = text.model_type == "mixtral"
    shared = mlp.shared_expert.down_proj.in_features if hasattr(mlp, "shared_expert") else 0
    return (experts, mlp.gate.top_k, width, True if mixtral else mlp.gate.norm_topk_prob, shared, mixtral)


def our_reading(config: dict) -> Reading:
    ours = ModelConfig.from_dict(config)
    ropes = [ours.layer_rope(i) for i in range(ours.num_hidden_layers)]
    return Reading(
        num_key_value_heads=ours.num_key_value_heads,
        head_dim=ours.head_dim,
        intermediate_size=ours.intermediate_size,
        query_scale=ours.query_scale,
        softcap=ours.attention_softcap,
        windows=ours.sliding_windows,
        ropes=tuple((tuple(r.inverse_frequency_array().astype(float)), r.attention_scaling) for r in ropes if r),
        qkv_bias=ours.qkv_bias,
        o_bias=ours.o_bias,
        qk_norm=ours.qk_norm,
        norm_position=ours.norm_position,
        norm_eps=ours.norm_eps,
        parallel_residual=ours.parallel_residual,
        mlp=ours.mlp,
        position_table=ours.position_table,
        activation=tuple(np.asarray(ACTIVATIONS[ours.activation](jnp.asarray(_POINTS))).astype(float)),
        moe=tuple(_our_moe(ours.moe_layer(i)) for i in range(ours.num_hidden_layers)),
    )


def _our_moe(moe) -> tuple | None:
    if moe is None:
        return None
    return (moe.num_experts, moe.top_k, moe.expert_size, moe.norm_topk_prob, moe.shared_expert_size,
            moe.float32_weights)  # fmt: skip


def assert_same_reading(ours: Reading, theirs: Reading) -> None:
    for field in dataclasses.fields(Reading):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if field.name == "ropes":
            for (inv_a, scale_a), (inv_b, scale_b) in zip(a, b, strict=True):
                np.testing.assert_allclose(inv_a, inv_b, rtol=2e-7, atol=0)
                assert scale_a == pytest.approx(scale_b, rel=1e-12)
        elif field.name in ("activation", "query_scale", "norm_eps"):  # the same formula, rounded differently
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
    "gemma3_text": {"sliding_window_pattern": 2}, "gemma3": {"sliding_window_pattern": 2},
    # Mixtures: few experts, narrow ones (their defaults are 8 to 128 experts); Qwen3-MoE slides every layer under
    # use_sliding_window, Qwen2-MoE refuses it (so its sliding_window is left as transformers' dense reading).
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "use_sliding_window": True},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
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
    fields = {**SIZES, **FAMILY_EXTRAS.get(model_type, {})}
    for name, value in states.items():
        if value is ABSENT:
            fields.pop(name, None)
        else:
            fields[name] = value
    config = config_of(model_type, fields)
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


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "phi3", "olmo2"])
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
    # GPT-2 as released spells its sizes n_embd, n_layer, n_head, n_positions (transformers' attribute_map).
    "gpt2-released-spelling": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_ctx": 128,
                                        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}),
    "gpt2-both-spellings-the-standard-name-wins": ("gpt2", {"n_embd": 32, "n_head": 2}),
    "gpt2-n_inner-and-exact-gelu": ("gpt2", {"n_inner": 80, "activation_function": "gelu"}),
    "gpt2-unscaled-attention": ("gpt2", {"scale_attn_weights": False}),
    "pythia-as-released": ("gpt_neox", {"rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
                                        "hidden_act": "gelu", "layer_norm_eps": 1e-5}),
    "neox-sequential-residual": ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 0.5}),
    "neox-without-attention-bias": ("gpt_neox", {"attention_bias": False}),
    "neox-v5-spelling": ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                          "partial_rotary_factor": 0.5}}),
    "neox-linear-scaling-whole-head": ("gpt_neox", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                                    "rotary_pct": 1.0}),
    "neox-head_dim-read-by-its-rotary-only": ("gpt_neox", {"head_dim": 32}),
    "phi3-mini-4k-like": ("phi3", {"num_key_value_heads": 4, "sliding_window": 5, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 256}),
    "phi4-mini-like-partial-longrope": ("phi3", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,
                                                 "rope_scaling": {"type": "longrope", "short_factor": [1, 1.5, 2, 3, 4, 5],
                                                                  "long_factor": [9.0] * 6}}),
    "phi3-su-spelling-is-longrope-with-its-own-length": (
        "phi3", {"original_max_position_embeddings": 32, "rope_scaling": {
            "type": "su", "short_factor": [1.0] * 7 + [3.0], "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64}}),
    "phi3-yarn-spelling-is-longrope": ("phi3", {"original_max_position_embeddings": 32, "rope_scaling": {
        "type": "yarn", "short_factor": [1.0] * 7 + [3.0], "long_factor": [2.0] * 8}}),
    "phi3-v5-spelling-partial": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                              "partial_rotary_factor": 0.5}}),
    "phi3-head_dim": ("phi3", {"head_dim": 8}),
    "olmo2-1124-like": ("olmo2", {"rope_theta": 500000, "rms_norm_eps": 1e-6}),
    "olmo2-attention-bias-and-yarn": ("olmo2", {"attention_bias": True, "rope_scaling": {"type": "yarn", "factor": 2.0}}),
    "olmo2-window-ignored-as-by-transformers": ("olmo2", {"sliding_window": 3}),
    "gemma-2b-like": ("gemma", {"head_dim": 16, "num_key_value_heads": 1, "hidden_act": "gelu"}),
    "gemma-1.1-like": ("gemma", {"head_dim": 16, "hidden_act": "gelu_pytorch_tanh",
                                 "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3-4b-multimodal-like": ("gemma3", {"head_dim": 16, "sliding_window": 4, "sliding_window_pattern": 2,
                                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HONOURED))
def test_family_settings_read_as_transformers_reads_them(case, tmp_path):
    model_type, fields = HONOURED[case]
    # The released GPT-2 spelling alone, without SIZES' standard names (which would win over it).
    sizes = {"vocab_size": 64} if case == "gpt2-released-spelling" else SIZES
    config = config_of(model_type, {**sizes, **fields})
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
    "gpt2-cross-attention": ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True is not supported"),
    "gpt2-layer-wise-scale": ("gpt2", {"scale_attn_by_inverse_layer_idx": True},
                              "scale_attn_by_inverse_layer_idx=True is not supported"),
    "neox-top-level-partial-rotary-ignored-by-transformers": (
        "gpt_neox", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is ignored by transformers .*rotary_pct"),
    "neox-top-level-theta-ignored-by-transformers": (
        "gpt_neox", {"rope_theta": 500.0}, "rope_theta=500.0 is ignored by transformers .*rotary_emb_base"),
    "olmo2-partial-rotary-ignored-by-its-default-rope": (
        "olmo2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported for this model type"),
    "gemma-bidirectional": ("gemma", {"use_bidirectional_attention": True},
                            "use_bidirectional_attention=True is not supported"),
    "gemma3-multimodal-text_config-not-an-object": ("gemma3", {"text_config": [1]}, "text_config must be a JSON object"),
    "deepseek-mla": ("deepseek_v3", {}, "model_type='deepseek_v3' is not supported \\(it needs multi-head latent "
                     "attention .*\\); supported model_type values are gpt2"),
    "gpt-oss-sinks": ("gpt_oss", {}, "model_type='gpt_oss' is not supported \\(it needs attention sinks"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_transformers_would_read_against_the_authors_intent_are_refused_naming_the_field(case):
    model_type, fields, needle = REFUSED[case]
    config = {"model_type": model_type, **SIZES, **fields} if "text_config" in fields else config_of(
        model_type, {**SIZES, **fields})  # fmt: skip
    with pytest.raises(BadInput, match=needle):
        ModelConfig.from_dict(config)


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
    "phi3-su-without-its-own-length": (
        "phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
        r"rope_scaling\.original_max_position_embeddings is missing"),
    "phi3-linear-rope": ("phi3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                         "rope_type='linear' is not supported for phi3"),
    "phi3-longrope-factors-of-the-wrong-length": (
        "phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}},
        r"short_factor must list 8 positive numbers"),
    "neox-rotary-wider-than-the-head": ("gpt_neox", {"head_dim": 128, "rotary_pct": 1.0}, "head_dim=128 makes the RoPE"),
    "gpt2-hidden-not-divisible-by-heads": ("gpt2", {"hidden_size": 66}, "hidden_size=66"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FAILING))
def test_settings_transformers_fails_on_are_refused_naming_the_field(case, tmp_path):
    model_type, fields, needle = FAILING[case]
    config = config_of(model_type, {**SIZES, **fields})
    with pytest.raises(BadInput, match=needle):
        ModelConfig.from_dict(config)
    assert transformers_refuses(tmp_path, config)
