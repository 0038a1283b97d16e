"""The model families, one registry entry each (`FAMILIES`, by config.json's `model_type`).

An entry (`Family`) holds everything that is the family's own:

- its config reader (`read`: one short function below, `_gpt2`, `_llama`, `_gemma2`, ...) and the defaults of its
  transformers config class (`DEFAULTS`), read exactly as transformers 5.24 reads them;
- its checkpoint's tensor names (`names`: a `extract.names.Scheme`);
- its hook sites (`sites`) and its planning figures (`mlp_weights`: the MLP weights one token multiplies with, which
  the cost model counts FLOPs from; the memory model counts every parameter of the built model).

Families: GPT-2, GPT-NeoX (Pythia), Llama 2/3, Mistral, Qwen2/2.5/3, Phi-3 (and Phi-4-mini), OLMo 2, Gemma 1/2/3
(Gemma 3's text-only checkpoints and the language model of its multimodal ones). They share one decoder
(`extract/model.py`); what differs between them is data in `extract.config.ModelConfig`. Adding a family is its
reader and its entry here (with its tensor names in `extract/names.py` where they are new), its small config in
`tests/extract_model/families.py` (which `tests/extract_model/test_family_registry.py` requires of every entry) and
its parity test (`tests/extract_model/test_family_parity.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from activations.format import ROUTER_SITES, SITES
from extract import names
from extract.errors import BadInput
from extract.experts import Moe
from extract.fields import Fields, decoder, qwen_windows, window, windows_from_layer_types
from extract.rope import DEFAULT_THETA, one_block, read_layer_type_ropes, resolve_block

if TYPE_CHECKING:  # annotations only: extract.config reads config.json through this registry
    from extract.config import ModelConfig


def layer_sites(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The hook sites decoder layer `layer` has: those of SITES its structure computes. No `resid_mid` where attention
    and MLP run in parallel (NeoX: no residual stream lies between them); the router's sites only in a mixture of
    experts, which has no one `mlp_hidden`."""
    moe = config.moe_layer(layer)
    return tuple(
        site for site in SITES
        if not (config.parallel_residual and site == "resid_mid")
        and not (site in ROUTER_SITES and moe is None)
        and not (site == "mlp_hidden" and moe is not None)
    )  # fmt: skip


def mlp_weights(config: ModelConfig, layer: int) -> int:
    """The MLP weights one token multiplies with in decoder layer `layer`: a dense MLP's matrices (three gated: gate,
    up, down; two plain), each hidden_size x intermediate_size; of a mixture of experts, the router, the `top_k`
    chosen experts' three matrices, and a shared expert with its gate. (The memory model counts every expert: it
    counts the built model's parameters.)"""
    d, moe = config.hidden_size, config.moe_layer(layer)
    if moe is None:
        return config.mlp_projections * d * config.intermediate_size
    shared = 3 * d * moe.shared_expert_size + d if moe.shared_expert_size else 0
    return d * moe.num_experts + moe.top_k * 3 * d * moe.expert_size + shared


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`: what messages call it (`name`), transformers' config class defaults for the fields read
    (`defaults`), its reader, its tensor names, transformers' `attribute_map` (`aliases`: our field name -> the name
    its config.json may use instead), its hook sites and its planning figures."""

    name: str
    defaults: Mapping[str, Any]
    #: (the config's fields, the fields every family reads alike) -> the rest of `ModelConfig`'s fields.
    read: Callable[[Fields, dict], dict]
    names: names.Scheme
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: transformers types num_key_value_heads `int | None` and reads a null as num_attention_heads.
    nullable_kv_heads: bool = False
    #: The model_type of the language model's config, nested as `text_config` (a multimodal checkpoint); None: the
    #: config is the language model's.
    text_config: str | None = None
    #: (config, decoder layer) -> the layer's hook sites.
    sites: Callable[[ModelConfig, int], tuple[str, ...]] = layer_sites
    mlp_weights: Callable[[ModelConfig, int], int] = mlp_weights

    def fields(self, raw: Mapping[str, Any], source: str, model_type: str) -> Fields:
        return Fields(raw, source, model_type, defaults=self.defaults, aliases=self.aliases,
                      nullable_kv_heads=self.nullable_kv_heads)  # fmt: skip

    def language_model(self, raw: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], str]:
        """The language model's config and where it is: config.json itself, or its `text_config` (Gemma3Config
        builds a Gemma3TextConfig from it, defaults included; absent or null is all defaults)."""
        if self.text_config is None:
            return raw, source
        text = raw.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, Mapping):
            raise BadInput(f"{source}: text_config must be a JSON object (the language model's config)")
        if text.get("model_type", self.text_config) != self.text_config:
            raise BadInput(f"{source}: text_config.model_type={text.get('model_type')!r} must be {self.text_config}")
        return text, f"{source} text_config"


#: Gemma 3's default local/global pattern: five sliding layers, then a global one (`sliding_window_pattern`).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
#: `Gemma3TextConfig.default_theta`: the global and local RoPE bases.
GEMMA3_THETA = {"full": 1_000_000.0, "sliding": 10_000.0}
#: GPT-NeoX's RoPE when its config leaves it out (`GPTNeoXConfig.convert_rope_params_to_dict`): `rotary_pct`,
#: `rotary_emb_base`.
NEOX_ROTARY_PCT, NEOX_ROTARY_BASE = 0.25, 10_000.0



def _gpt2(f: Fields, common: dict) -> dict:
    """GPT-2: learned absolute positions, LayerNorm with bias, biases everywhere, a plain MLP (4 x hidden unless
    n_inner), Conv1D weights stored [in, out] (extract/names.py)."""
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    for name, what in (("add_cross_attention", "cross-attention"),
                       ("scale_attn_by_inverse_layer_idx", "a softmax scale per layer")):  # fmt: skip
        if f.flag(name):
            raise f.bad(name, f"is not supported ({what}); no released GPT-2 checkpoint uses it")
    head_dim = f.divided_head_dim(hidden, heads)
    inner = f.get("n_inner")
    return dict(
        intermediate_size=4 * hidden if inner is None else f.positive("n_inner"), num_key_value_heads=heads,
        head_dim=head_dim, norm_eps=f.number("layer_norm_epsilon"), rope=None, norm="layer_norm", mlp="plain",
        activation=f.activation("activation_function"), qkv_bias=True, o_bias=True, mlp_bias=True,
        position_table=f.positive("max_position_embeddings"),
        query_scale=head_dim**-0.5 if f.flag("scale_attn_weights") else 1.0,
        sliding_windows=(None,) * common["num_hidden_layers"],
    )  # fmt: skip


def _gpt_neox(f: Fields, common: dict) -> dict:
    """GPT-NeoX (Pythia): LayerNorm with bias, attention and MLP in parallel from the same residual (unless
    use_parallel_residual is false), a plain MLP with biases, fused query_key_value, partial rotary (`rotary_pct`,
    0.25 unless given; the base `rotary_emb_base`)."""
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    head_dim = f.divided_head_dim(hidden, heads)
    # GPTNeoXConfig.convert_rope_params_to_dict: the RoPE block, theta from rotary_emb_base and the rotated fraction
    # from rotary_pct; a top-level rope_theta or partial_rotary_factor is not read.
    field, block = one_block(f.raw, f.source)
    block.setdefault("rope_theta", f.raw.get("rotary_emb_base", NEOX_ROTARY_BASE))
    block.setdefault("partial_rotary_factor", f.raw.get("rotary_pct", NEOX_ROTARY_PCT))
    f.refuse_ignored("rope_theta", block["rope_theta"],
                     "its RoPE base is rotary_emb_base or rope_parameters.rope_theta")  # fmt: skip
    f.refuse_ignored("partial_rotary_factor", block["partial_rotary_factor"],
                     "its rotated fraction is rotary_pct or rope_parameters.partial_rotary_factor")  # fmt: skip
    # Its rotary embedding (not its attention) takes a head_dim given in config.json.
    rotary_head_dim = f.positive("head_dim") if f.raw.get("head_dim") is not None else head_dim
    rope = resolve_block(
        block, field, rotary_head_dim, f.source, max_position_embeddings=f.positive("max_position_embeddings"),
        original=f.raw.get("original_max_position_embeddings"), partial_rotary=True,
    )  # fmt: skip
    if rope.rotary_dim > head_dim:
        raise f.bad("head_dim", f"makes the RoPE rotate {rope.rotary_dim} values of heads of {head_dim} "
                    "(hidden_size / num_attention_heads); transformers fails on this config too")  # fmt: skip
    bias = f.flag("attention_bias")
    return dict(
        intermediate_size=f.positive("intermediate_size"), num_key_value_heads=heads, head_dim=head_dim,
        norm_eps=f.number("layer_norm_eps"), rope=rope, norm="layer_norm", mlp="plain",
        parallel_residual=f.flag("use_parallel_residual"), activation=f.activation("hidden_act"),
        qkv_bias=bias, o_bias=bias, mlp_bias=True, sliding_windows=(None,) * common["num_hidden_layers"],
    )  # fmt: skip


def _qwen2(f: Fields, common: dict) -> dict:
    """Qwen2 / Qwen2.5: biases on q, k and v (never on o); head_dim is hidden / heads unless given."""
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=True, activation=f.activation("hidden_act"),
        sliding_windows=qwen_windows(f, common["num_hidden_layers"]),
    )  # fmt: skip


def _qwen3(f: Fields, common: dict) -> dict:
    """Qwen3: per-head q/k RMSNorm before RoPE; head_dim 128 unless given; biases (q, k, v, o) only under
    attention_bias."""
    head_dim, bias = f.positive("head_dim"), f.flag("attention_bias")
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, qk_norm="head",
        activation=f.activation("hidden_act"), sliding_windows=qwen_windows(f, common["num_hidden_layers"]),
    )  # fmt: skip


def _llama(f: Fields, common: dict) -> dict:
    """Llama 2, 3, 3.1, 3.2 (llama3 RoPE scaling): no biases unless attention_bias; never a window."""
    f.require_divisible_heads(common["hidden_size"], common["num_attention_heads"])
    if f.flag("mlp_bias"):
        raise f.bad("mlp_bias", "is not supported (MLP biases); no released Llama has them")
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=True)
    bias = f.flag("attention_bias")
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, activation=f.activation("hidden_act"),
        sliding_windows=(None,) * common["num_hidden_layers"],
    )  # fmt: skip


def _mistral(f: Fields, common: dict) -> dict:
    """Mistral: no biases; every layer slides over `sliding_window` (4096 when absent, no window when null)."""
    if "layer_types" in f.raw:
        raise BadInput(
            f"{f.source}: layer_types is given, but transformers' MistralModel ignores it and slides every layer "
            "(it warns: use a Ministral model type); remove layer_types, or set sliding_window null for none"
        )
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=True)
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), activation=f.activation("hidden_act"),
        sliding_windows=(window(f),) * common["num_hidden_layers"],
    )  # fmt: skip


def _phi3(f: Fields, common: dict) -> dict:
    """Phi-3, Phi-3.5, Phi-4-mini: fused qkv_proj and gate_up_proj (extract/names.py); every layer slides over
    `sliding_window` when it is set (none by default); partial rotary (`partial_rotary_factor`); LongRoPE (its `su`
    and `yarn` spellings too) with the pretraining length `original_max_position_embeddings` (4096 unless given)."""
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    # Phi3Config.convert_rope_params_to_dict: its own defaults, and every scaled RoPE is LongRoPE.
    field, block = one_block(f.raw, f.source)
    block.setdefault("rope_theta", f.raw.get("rope_theta", DEFAULT_THETA))
    block.setdefault("partial_rotary_factor", f.raw.get("partial_rotary_factor", 1.0))
    rope_type = block.get("rope_type", block.get("type", "default"))
    # transformers standardises the block (a longrope or yarn one takes the top-level original length), renames su
    # and yarn to longrope and validates it, so an su block must carry an original length of its own; computing the
    # frequencies standardises again, and the top-level length (4096 unless given) wins after all.
    original = f.positive("original_max_position_embeddings")
    if rope_type == "su" and "original_max_position_embeddings" not in block:
        raise BadInput(f"{f.source}: {field}.original_max_position_embeddings is missing; an su (LongRoPE) block needs "
                       "it (transformers fails on this config too): add it, or write type longrope")  # fmt: skip
    if rope_type in ("su", "yarn"):
        block["rope_type"] = rope_type = "longrope"
    if rope_type not in ("default", "longrope"):
        raise BadInput(f"{f.source}: {field}.rope_type={rope_type!r} is not supported for phi3 (transformers refuses "
                       "it too); Phi-3 uses the default RoPE or longrope")  # fmt: skip
    rope = resolve_block(block, field, head_dim, f.source, max_position_embeddings=f.positive(
        "max_position_embeddings"), original=original, partial_rotary=True)  # fmt: skip
    return decoder(
        f, common, head_dim, rope=rope, activation=f.activation("hidden_act"),
        sliding_windows=(window(f),) * common["num_hidden_layers"],
    )  # fmt: skip


def _olmo2(f: Fields, common: dict) -> dict:
    """OLMo 2: norms only after the sublayers (the attention and the MLP read the residual stream itself), RMSNorm
    scaled in float32, q/k RMSNorm over the whole projection (all heads at once) before RoPE; biases on q, k, v, o
    only under attention_bias."""
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    bias = f.flag("attention_bias")
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), norm="rms_scale_in_float32", norm_position="after",
        qk_norm="projection", qkv_bias=bias, o_bias=bias, activation=f.activation("hidden_act"),
        sliding_windows=(None,) * common["num_hidden_layers"],
    )  # fmt: skip


def _gemma_common(f: Fields, common: dict, activation: str) -> dict:
    """What every Gemma shares: (1 + w) RMSNorms, GeGLU, embeddings times sqrt(hidden_size), head_dim 256 unless
    given, no bidirectional attention."""
    f.require_divisible_heads(common["hidden_size"], common["num_attention_heads"])
    if f.get("use_bidirectional_attention"):
        raise f.bad("use_bidirectional_attention", "is not supported: these are causal language models")
    bias = f.flag("attention_bias")
    return decoder(
        f, common, f.positive("head_dim"), qkv_bias=bias, o_bias=bias, norm="rms_one_plus", embedding_scale=True,
        activation=activation,
    )  # fmt: skip


def _gemma(f: Fields, common: dict) -> dict:
    """Gemma 1: pre-norms only; no window; `hidden_act` "gelu" means the tanh approximation, as transformers'
    GemmaConfig rewrites it."""
    activation = "gelu_tanh" if f.get("hidden_act") == "gelu" else f.activation("hidden_act")
    gemma = _gemma_common(f, common, activation)
    return dict(gemma, rope=f.rope(gemma["head_dim"]), sliding_windows=(None,) * common["num_hidden_layers"])


def _gemma2_like(f: Fields, common: dict, default_layer_types: list[str]) -> dict:
    """What Gemma 2 and Gemma 3 share: pre- and post-norms around attention and MLP, the tanh GELU, logits scaled by
    1/sqrt(query_pre_attn_scalar), layer types that choose the sliding layers."""
    return dict(
        _gemma_common(f, common, f.activation("hidden_activation")), norm_position="around",
        query_scale=f.positive("query_pre_attn_scalar") ** -0.5,
        sliding_windows=windows_from_layer_types(f, default_layer_types, f.get("sliding_window"), "sliding_window is null"),
    )  # fmt: skip


def _gemma2(f: Fields, common: dict) -> dict:
    """Gemma 2: attention logits soft-capped (`attn_logit_softcapping`, 50 unless null); layers alternate sliding
    (even) and global (odd)."""
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(common["num_hidden_layers"])]
    gemma = _gemma2_like(f, common, alternating)
    return dict(gemma, rope=f.rope(gemma["head_dim"]), attention_softcap=f.number("attn_logit_softcapping", nullable=True))


def _gemma3(f: Fields, common: dict) -> dict:
    """Gemma 3 text (also the language model of the multimodal checkpoints, read from their text_config): q/k norms;
    a global RoPE (theta 1e6) and a local one for sliding layers (10000); five sliding layers per global one. Its
    `attn_logit_softcapping` is read by transformers but never applied, so not here either."""
    pattern = f.raw.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise BadInput(f"{f.source}: sliding_window_pattern={pattern!r} must be a positive integer")
    five_to_one = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(common["num_hidden_layers"])]
    gemma = _gemma2_like(f, common, five_to_one)
    full, sliding = read_layer_type_ropes(
        f.raw, gemma["head_dim"], f.source, max_position_embeddings=f.defaults["max_position_embeddings"],
        full_theta=GEMMA3_THETA["full"], sliding_theta=GEMMA3_THETA["sliding"],
    )  # fmt: skip
    return dict(gemma, rope=full, sliding_rope=sliding, qk_norm="head")


# -- mixtures of experts (extract/experts.py) ----------------------------------------------------------------------


def _experts(f: Fields, num_layers: int, *, experts: str, size: str, norm_topk_prob: bool | None = None,
             shared: bool = False, sparse_step: bool = False, float32_weights: bool = False) -> Moe:  # fmt: skip
    """The mixture's sizes from the fields named `experts` and `size`; `norm_topk_prob` fixed (Mixtral) or read;
    Qwen-MoE's sparse layers (`sparse_step`): layer i is sparse unless listed in mlp_only_layers, where
    (i + 1) % decoder_sparse_step == 0 (its DecoderLayer's rule).

    The count of experts may be written under either name, `num_experts` or `num_local_experts`: each config class
    maps one to the other (its `attribute_map`), and Qwen3MoeConfig saves its `num_experts` as num_local_experts."""
    other = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}[experts]
    if not f.given(experts) and f.given(other):
        experts = other
    num_experts, top_k = f.positive(experts), f.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise f.bad("num_experts_per_tok", f"is more than the {num_experts} experts ({f.key(experts)})")
    sparse = [True] * num_layers
    if sparse_step:
        step, dense = f.positive("decoder_sparse_step"), f.get("mlp_only_layers")
        dense = [] if dense is None else dense
        if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise f.bad("mlp_only_layers", "must be a list of decoder layers (from 0) whose MLP is dense")
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    return Moe(
        num_experts=num_experts, top_k=top_k, expert_size=f.positive(size),
        norm_topk_prob=f.flag("norm_topk_prob") if norm_topk_prob is None else norm_topk_prob,
        sparse_layers=tuple(sparse), shared_expert_size=f.positive("shared_expert_intermediate_size") if shared else 0,
        float32_weights=float32_weights,
    )  # fmt: skip


def _mixtral(f: Fields, common: dict) -> dict:
    """Mixtral: Mistral's layer (every layer slides over `sliding_window` when set; none by default) with a mixture of
    `num_local_experts` SwiGLU experts of intermediate_size in every layer; the chosen weights always renormalised
    and kept in float32 (`MixtralTopKRouter`)."""
    num_layers = common["num_hidden_layers"]
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=True)
    moe = _experts(f, num_layers, experts="num_local_experts", size="intermediate_size", norm_topk_prob=True,
                   float32_weights=True)  # fmt: skip
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim, default_theta=MIXTRAL_THETA), activation=f.activation("hidden_act"),
        sliding_windows=(window(f),) * num_layers, moe=moe,
    )  # fmt: skip


#: `MixtralConfig.default_theta`: its RoPE base when config.json gives none.
MIXTRAL_THETA = 1_000_000.0


def _no_sliding(f: Fields, why: str) -> None:
    if f.flag("use_sliding_window"):
        raise f.bad("use_sliding_window", f"is not supported for {f.model_type} ({why}); set it false")


def _qwen2_moe(f: Fields, common: dict) -> dict:
    """Qwen1.5-MoE, Qwen2-MoE: Qwen2's attention (biases on q, k, v under `qkv_bias`); a mixture of
    `moe_intermediate_size` experts plus a shared expert (`shared_expert_intermediate_size`) whose output is scaled by
    sigmoid(x · shared_expert_gate); dense layers by `decoder_sparse_step` and `mlp_only_layers`. Sliding windows are
    refused: no released checkpoint uses them."""
    _no_sliding(f, "no released checkpoint slides")
    num_layers = common["num_hidden_layers"]
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    moe = _experts(f, num_layers, experts="num_experts", size="moe_intermediate_size", shared=True, sparse_step=True)
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=f.flag("qkv_bias"), activation=f.activation("hidden_act"),
        sliding_windows=(None,) * num_layers, moe=moe,
    )  # fmt: skip


def _qwen3_moe(f: Fields, common: dict) -> dict:
    """Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm; biases under attention_bias; every layer slides over
    `sliding_window` only under use_sliding_window); a mixture of `moe_intermediate_size` experts, no shared expert;
    dense layers by `decoder_sparse_step` and `mlp_only_layers`; `norm_topk_prob` either way."""
    num_layers = common["num_hidden_layers"]
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    slides = f.flag("use_sliding_window") and f.get("sliding_window") is not None
    bias = f.flag("attention_bias")
    moe = _experts(f, num_layers, experts="num_experts", size="moe_intermediate_size", sparse_step=True)
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, qk_norm="head",
        activation=f.activation("hidden_act"),
        sliding_windows=((f.positive("sliding_window") if slides else None),) * num_layers, moe=moe,
    )  # fmt: skip


def _olmoe(f: Fields, common: dict) -> dict:
    """OLMoE: norms before the sublayers (Llama's RMSNorm), q/k RMSNorm over the whole projection (all heads at once)
    before RoPE, biases under attention_bias; a mixture of `num_experts` SwiGLU experts of intermediate_size in every
    layer. `clip_qkv` (clamping q, k, v) is refused: no released OLMoE uses it. Its config class has no window, but
    its attention passes a `sliding_window` that config.json gives to every layer (none when absent)."""
    if f.get("clip_qkv") is not None:
        raise f.bad("clip_qkv", "is not supported (clamping q, k and v); no released OLMoE sets it: make it null")
    num_layers = common["num_hidden_layers"]
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    head_dim = f.head_dim(hidden, heads, null_means_divided=False)
    if head_dim * heads != hidden:  # OlmoeAttention sizes its q norm by hidden_size: transformers fails otherwise
        raise f.bad("head_dim", f"times num_attention_heads={heads} must be hidden_size={hidden}: OLMoE's q/k norms "
                    "are hidden_size wide (transformers fails on this config too)")  # fmt: skip
    bias = f.flag("attention_bias")
    moe = _experts(f, num_layers, experts="num_experts", size="intermediate_size")
    return decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, qk_norm="projection",
        activation=f.activation("hidden_act"), sliding_windows=(window(f),) * num_layers, moe=moe,
    )  # fmt: skip


#: The defaults of transformers' config classes (5.24) for every field read here; they apply when config.json leaves
#: the field out. `tests/extract_model/test_families.py` checks them against the classes themselves.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_QWEN = dict(zip(_SIZES, (151936, 4096, 22016, 32, 32)), num_key_value_heads=32, hidden_act="silu",
             max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=4096,
             max_window_layers=28, layer_types=None)  # fmt: skip
_GEMMA = dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
              attention_bias=False, sliding_window=4096, query_pre_attn_scalar=256, layer_types=None)  # fmt: skip
_GEMMA3 = dict(zip(_SIZES, (262208, 2304, 9216, 26, 8)), **_GEMMA, max_position_embeddings=131072,
               use_bidirectional_attention=False)  # fmt: skip
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False),
    "gpt_neox": dict(zip(_SIZES, (50432, 6144, 24576, 44, 64)), hidden_act="gelu", max_position_embeddings=2048,
                     layer_norm_eps=1e-5, use_parallel_residual=True, attention_bias=True),
    "llama": dict(zip(_SIZES, (32000, 4096, 11008, 32, 32)), num_key_value_heads=None, head_dim=None,
                  hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, attention_bias=False,
                  mlp_bias=False),
    "mistral": dict(zip(_SIZES, (32000, 4096, 14336, 32, 32)), num_key_value_heads=8, head_dim=None,
                    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=4096),
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "phi3": dict(zip(_SIZES, (32064, 3072, 8192, 32, 32)), num_key_value_heads=None, hidden_act="silu",
                 max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                 sliding_window=None),
    "olmo2": dict(zip(_SIZES, (50304, 4096, 11008, 32, 32)), num_key_value_heads=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-5, attention_bias=False),
    "gemma": dict(zip(_SIZES, (256000, 3072, 24576, 28, 16)), num_key_value_heads=16, head_dim=256,
                  hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                  attention_bias=False, use_bidirectional_attention=None),
    "gemma2": dict(zip(_SIZES, (256000, 2304, 9216, 26, 8)), **_GEMMA, max_position_embeddings=8192,
                   attn_logit_softcapping=50.0, use_bidirectional_attention=None),
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3,  # the multimodal checkpoints' text_config is a Gemma3TextConfig
    "mixtral": dict(zip(_SIZES, (32000, 4096, 14336, 32, 32)), num_key_value_heads=8, head_dim=None,
                    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=None,
                    num_experts_per_tok=2, num_local_experts=8),
    "qwen2_moe": dict(zip(_SIZES, (151936, 2048, 5632, 24, 16)), num_key_value_heads=16, hidden_act="silu",
                      max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
                      decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      num_experts_per_tok=4, num_experts=60, norm_topk_prob=False, mlp_only_layers=None,
                      qkv_bias=True),
    "qwen3_moe": dict(zip(_SIZES, (151936, 2048, 6144, 24, 32)), num_key_value_heads=4, hidden_act="silu",
                      max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=False,
                      use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
                      num_experts_per_tok=8, num_experts=128, norm_topk_prob=False, mlp_only_layers=None),
    "olmoe": dict(zip(_SIZES, (50304, 2048, 2048, 16, 16)), num_key_value_heads=None, hidden_act="silu",
                  max_position_embeddings=4096, rms_norm_eps=1e-5, attention_bias=False, clip_qkv=None,
                  num_experts_per_tok=8, num_experts=64, norm_topk_prob=False),
}  # fmt: skip

#: model_type -> its family. Qwen2.5 checkpoints say "qwen2"; Llama 2 to 3.2 say "llama"; Pythia "gpt_neox";
#: Phi-3.5 and Phi-4-mini "phi3".
FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT-2", DEFAULTS["gpt2"], _gpt2, names.GPT2, aliases={
        "hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions"}),
    "gpt_neox": Family("GPT-NeoX, Pythia", DEFAULTS["gpt_neox"], _gpt_neox, names.GPT_NEOX),
    "llama": Family("Llama 2, 3, 3.1, 3.2", DEFAULTS["llama"], _llama, names.LLAMA, nullable_kv_heads=True),
    "mistral": Family("Mistral", DEFAULTS["mistral"], _mistral, names.LLAMA),
    "qwen2": Family("Qwen2, Qwen2.5", DEFAULTS["qwen2"], _qwen2, names.LLAMA, nullable_kv_heads=True),
    "qwen3": Family("Qwen3 dense", DEFAULTS["qwen3"], _qwen3, names.LLAMA, nullable_kv_heads=True),
    "phi3": Family("Phi-3, Phi-3.5, Phi-4-mini", DEFAULTS["phi3"], _phi3, names.PHI3, nullable_kv_heads=True),
    "olmo2": Family("OLMo 2", DEFAULTS["olmo2"], _olmo2, names.LLAMA, nullable_kv_heads=True),
    "gemma": Family("Gemma 1", DEFAULTS["gemma"], _gemma, names.LLAMA),
    "gemma2": Family("Gemma 2", DEFAULTS["gemma2"], _gemma2, names.LLAMA),
    "gemma3_text": Family("Gemma 3 text-only", DEFAULTS["gemma3_text"], _gemma3, names.LLAMA),
    "gemma3": Family("Gemma 3 multimodal, its language model", DEFAULTS["gemma3"], _gemma3, names.GEMMA3_MULTIMODAL,
                     text_config="gemma3_text"),
    "mixtral": Family("Mixtral", DEFAULTS["mixtral"], _mixtral, names.MIXTRAL),
    "qwen2_moe": Family("Qwen1.5-MoE, Qwen2-MoE", DEFAULTS["qwen2_moe"], _qwen2_moe, names.QWEN2_MOE),
    "qwen3_moe": Family("Qwen3-MoE", DEFAULTS["qwen3_moe"], _qwen3_moe, names.QWEN_MOE),
    "olmoe": Family("OLMoE", DEFAULTS["olmoe"], _olmoe, names.QWEN_MOE, nullable_kv_heads=True),
}  # fmt: skip

