"""Which checkpoint tensor holds each model parameter, in each family's own names and layouts.

A parameter is a path in the Flax model (`extract/model.py`): `("embedding",)`, `("layers", 3, "attention",
"q_proj")`, `("layers", 3, "mlp_norm", "scale")`. `tensor_for(config, path, prefix)` names the Hugging Face tensor that
holds it (`Stored`): its name, how it is stored, and, for a fused tensor, which part of it is the parameter.

- `linear`: a torch `Linear` weight, [out, in]; transposed to the model's [in, ...] layout.
- `conv1d`: GPT-2's `Conv1D` weight, stored [in, out] already.
- `vector`: biases, norm scales, embeddings: as stored.

Fused tensors are split at load, by ranged reads of the rows the parameter owns (rows of a `Linear` weight or a bias
are contiguous in the file): Phi-3's `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up]); GPT-NeoX's
`query_key_value`, whose rows are per head, [q_h; k_h; v_h] for each head h in turn (it views the projection as
[..., heads, 3 * head_dim] and chunks the last axis); GPT-2's `c_attn`, a Conv1D whose q, k and v are column blocks
(read whole, then sliced).

Each family's names are one `Scheme`, which its entry in the family registry (`extract.families.FAMILIES`) holds: the
tensor prefixes its checkpoints use (tried in order: the first under which
the embedding exists), the names outside the layers, and those of one layer. The Llama-like families share one layer
table whose norms are named by where they sit (`ModelConfig.norm_position`: `input_layernorm` and
`post_attention_layernorm` before the sublayers; Gemma 2's four; OLMo 2's two after).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the family registry, which extract.config reads through, holds these schemes
    from extract.config import ModelConfig

Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one parameter is in the checkpoint: the tensor's full name, its layout (`linear`, `conv1d`, `vector`)
    and, for a part of a fused tensor, the [start, end) ranges it owns along the output axis (rows of a `linear`
    weight or a vector, columns of a `conv1d` weight), in order; None for the whole tensor."""

    name: str
    layout: str = "vector"
    ranges: Ranges | None = None
    #: A mixture's experts, one tensor each (as released): `name` holds `{}` for the expert's index, and the
    #: parameter is their `experts` tensors stacked, expert 0 first. 0: one tensor.
    experts: int = 0

    def expert_names(self) -> tuple[str, ...]:
        return tuple(self.name.format(e) for e in range(self.experts))


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    layout: str = "vector"
    part: Callable[[ModelConfig], Ranges] | None = None
    experts: bool = False  # one tensor per expert: `name` holds `{}` for its index


def _linear(name: str, part: Callable[[ModelConfig], Ranges] | None = None) -> _Entry:
    return _Entry(name, "linear", part)


def _block(index: int, sizes: Callable[[ModelConfig], Sequence[int]]) -> Callable[[ModelConfig], Ranges]:
    """Block `index` of a tensor that concatenates blocks of `sizes(config)` along its output axis."""

    def ranges(config: ModelConfig) -> Ranges:
        widths = list(sizes(config))
        start = sum(widths[:index])
        return ((start, start + widths[index]),)

    return ranges


def _per_head(index: int) -> Callable[[ModelConfig], Ranges]:
    """GPT-NeoX's query_key_value: per head h, rows [q_h; k_h; v_h] of head_dim each; part `index` of every head."""

    def ranges(config: ModelConfig) -> Ranges:
        h = config.head_dim
        starts = (head * 3 * h + index * h for head in range(config.num_attention_heads))
        return tuple((start, start + h) for start in starts)

    return ranges


def _qkv(c: ModelConfig) -> tuple[int, int, int]:
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return q, kv, kv


def _thirds(c: ModelConfig) -> tuple[int, int, int]:
    return (c.hidden_size,) * 3


def _halves(c: ModelConfig) -> tuple[int, int]:
    return (c.intermediate_size,) * 2


def _norm(name: str, bias: bool = False) -> dict[tuple[str, ...], _Entry]:
    """A norm module's tensors under `name` (its scale, and a LayerNorm's bias)."""
    return {("scale",): _Entry(f"{name}.weight"), **({("bias",): _Entry(f"{name}.bias")} if bias else {})}


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One family's names: `prefixes` of its checkpoints (tried in order), `model` the tensors outside the layers,
    `layer` the template of a layer's prefix, `layers(config)` a layer's tensors by parameter path under the layer."""

    prefixes: tuple[str, ...]
    model: Mapping[tuple[str, ...], _Entry]
    layer: str
    layers: Callable[[ModelConfig], Mapping[tuple[str, ...], _Entry]]


# -- the Llama-like families (Qwen, Llama, Mistral, Phi-3, OLMo 2, Gemma) ------------------------------------------

#: Their norms by where they sit: Llama's `post_attention_layernorm` is the MLP's input norm, Gemma 2's and OLMo 2's
#: the norm on the attention's output.
_LLAMA_NORMS = {
    "before": {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "around": {"attention_norm": "input_layernorm", "attention_out_norm": "post_attention_layernorm",
               "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
    "after": {"attention_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
}  # fmt: skip
_LLAMA_ATTENTION = {
    ("attention", "q_proj"): _linear("self_attn.q_proj.weight"),
    ("attention", "k_proj"): _linear("self_attn.k_proj.weight"),
    ("attention", "v_proj"): _linear("self_attn.v_proj.weight"),
    ("attention", "o_proj"): _linear("self_attn.o_proj.weight"),
    ("attention", "q_bias"): _Entry("self_attn.q_proj.bias"),
    ("attention", "k_bias"): _Entry("self_attn.k_proj.bias"),
    ("attention", "v_bias"): _Entry("self_attn.v_proj.bias"),
    ("attention", "o_bias"): _Entry("self_attn.o_proj.bias"),
    ("attention", "q_norm", "scale"): _Entry("self_attn.q_norm.weight"),
    ("attention", "k_norm", "scale"): _Entry("self_attn.k_norm.weight"),
}
_LLAMA_MLP = {
    ("mlp", "gate_proj"): _linear("mlp.gate_proj.weight"),
    ("mlp", "up_proj"): _linear("mlp.up_proj.weight"),
    ("mlp", "down_proj"): _linear("mlp.down_proj.weight"),
}
#: Phi-3's fused projections: qkv_proj is [q; k; v] by rows, gate_up_proj [gate; up].
_PHI3_FUSED = {
    ("attention", "q_proj"): _linear("self_attn.qkv_proj.weight", _block(0, _qkv)),
    ("attention", "k_proj"): _linear("self_attn.qkv_proj.weight", _block(1, _qkv)),
    ("attention", "v_proj"): _linear("self_attn.qkv_proj.weight", _block(2, _qkv)),
    ("mlp", "gate_proj"): _linear("mlp.gate_up_proj.weight", _block(0, _halves)),
    ("mlp", "up_proj"): _linear("mlp.gate_up_proj.weight", _block(1, _halves)),
}


def _llama_layer(config: ModelConfig, fused: Mapping | None = None) -> dict[tuple[str, ...], _Entry]:
    norms = {
        (module, *key): entry
        for module, name in _LLAMA_NORMS[config.norm_position].items()
        for key, entry in _norm(name).items()
    }
    return {**_LLAMA_ATTENTION, **_LLAMA_MLP, **norms, **(fused or {})}


LLAMA = Scheme(
    prefixes=("model.", ""),
    model={("embedding",): _Entry("embed_tokens.weight"), ("final_norm", "scale"): _Entry("norm.weight")},
    layer="layers.{}.",
    layers=_llama_layer,
)

# -- mixtures of experts (Mixtral, Qwen-MoE, OLMoE) ------------------------------------------------------------
#: Every expert is its own SwiGLU MLP, one Linear tensor each, as released and as transformers 5 saves them (its
#: checkpoint conversion mapping merges them into [experts, ...] tensors at load and splits them again at save:
#: transformers/conversion_mapping.py, "mixtral" and "qwen2_moe", which qwen3_moe and olmoe share). The router is
#: one Linear of [experts, hidden]. Dense layers of a Qwen-MoE keep Qwen2's `mlp.*_proj` names.


def _experts(block: str, router: str, gate: str, up: str, down: str) -> dict[tuple[str, ...], _Entry]:
    return {
        ("mlp", "router"): _linear(f"{block}.{router}.weight"),
        ("mlp", "experts", "gate_proj"): _Entry(f"{block}.experts.{{}}.{gate}.weight", "linear", experts=True),
        ("mlp", "experts", "up_proj"): _Entry(f"{block}.experts.{{}}.{up}.weight", "linear", experts=True),
        ("mlp", "experts", "down_proj"): _Entry(f"{block}.experts.{{}}.{down}.weight", "linear", experts=True),
    }


_QWEN_SHARED = {
    ("mlp", "shared_expert", "gate_proj"): _linear("mlp.shared_expert.gate_proj.weight"),
    ("mlp", "shared_expert", "up_proj"): _linear("mlp.shared_expert.up_proj.weight"),
    ("mlp", "shared_expert", "down_proj"): _linear("mlp.shared_expert.down_proj.weight"),
    ("mlp", "shared_expert_gate"): _linear("mlp.shared_expert_gate.weight"),
}


def _moe_layer(experts: Mapping) -> Callable[[ModelConfig], dict[tuple[str, ...], _Entry]]:
    return lambda config: {**_llama_layer(config), **experts}


# -- GPT-2 and GPT-NeoX ------------------------------------------------------------------------------------------


def _gpt2_layer(config: ModelConfig) -> dict[tuple[str, ...], _Entry]:
    def conv1d(name: str, part=None) -> _Entry:
        return _Entry(name, "conv1d", part)

    return {
        **{("attention_norm", *k): e for k, e in _norm("ln_1", bias=True).items()},
        **{("mlp_norm", *k): e for k, e in _norm("ln_2", bias=True).items()},
        ("attention", "q_proj"): conv1d("attn.c_attn.weight", _block(0, _thirds)),
        ("attention", "k_proj"): conv1d("attn.c_attn.weight", _block(1, _thirds)),
        ("attention", "v_proj"): conv1d("attn.c_attn.weight", _block(2, _thirds)),
        ("attention", "q_bias"): _Entry("attn.c_attn.bias", part=_block(0, _thirds)),
        ("attention", "k_bias"): _Entry("attn.c_attn.bias", part=_block(1, _thirds)),
        ("attention", "v_bias"): _Entry("attn.c_attn.bias", part=_block(2, _thirds)),
        ("attention", "o_proj"): conv1d("attn.c_proj.weight"),
        ("attention", "o_bias"): _Entry("attn.c_proj.bias"),
        ("mlp", "up_proj"): conv1d("mlp.c_fc.weight"),
        ("mlp", "up_bias"): _Entry("mlp.c_fc.bias"),
        ("mlp", "down_proj"): conv1d("mlp.c_proj.weight"),
        ("mlp", "down_bias"): _Entry("mlp.c_proj.bias"),
    }


def _neox_layer(config: ModelConfig) -> dict[tuple[str, ...], _Entry]:
    qkv = "attention.query_key_value"
    return {
        **{("attention_norm", *k): e for k, e in _norm("input_layernorm", bias=True).items()},
        **{("mlp_norm", *k): e for k, e in _norm("post_attention_layernorm", bias=True).items()},
        **{("attention", f"{p}_proj"): _linear(f"{qkv}.weight", _per_head(i)) for i, p in enumerate("qkv")},
        **{("attention", f"{p}_bias"): _Entry(f"{qkv}.bias", part=_per_head(i)) for i, p in enumerate("qkv")},
        ("attention", "o_proj"): _linear("attention.dense.weight"),
        ("attention", "o_bias"): _Entry("attention.dense.bias"),
        ("mlp", "up_proj"): _linear("mlp.dense_h_to_4h.weight"),
        ("mlp", "up_bias"): _Entry("mlp.dense_h_to_4h.bias"),
        ("mlp", "down_proj"): _linear("mlp.dense_4h_to_h.weight"),
        ("mlp", "down_bias"): _Entry("mlp.dense_4h_to_h.bias"),
    }


#: The families' schemes (each family's entry in `extract.families.FAMILIES` names one). Gemma 3's multimodal
#: checkpoints keep the language model under `language_model.model.` as released (and as transformers 5 saves them),
#: or `model.language_model.` as some transformers 4 versions saved them.
GPT2 = Scheme(
    prefixes=("transformer.", ""),
    model={("embedding",): _Entry("wte.weight"), ("position_embedding",): _Entry("wpe.weight"),
           **{("final_norm", *k): e for k, e in _norm("ln_f", bias=True).items()}},
    layer="h.{}.",
    layers=_gpt2_layer,
)  # fmt: skip
GPT_NEOX = Scheme(
    prefixes=("gpt_neox.", ""),
    model={("embedding",): _Entry("embed_in.weight"),
           **{("final_norm", *k): e for k, e in _norm("final_layer_norm", bias=True).items()}},
    layer="layers.{}.",
    layers=_neox_layer,
)  # fmt: skip
PHI3 = dataclasses.replace(LLAMA, layers=lambda config: _llama_layer(config, _PHI3_FUSED))
MIXTRAL = dataclasses.replace(LLAMA, layers=_moe_layer(_experts("block_sparse_moe", "gate", "w1", "w3", "w2")))
QWEN_MOE = dataclasses.replace(LLAMA, layers=_moe_layer(_experts("mlp", "gate", "gate_proj", "up_proj", "down_proj")))
QWEN2_MOE = dataclasses.replace(QWEN_MOE, layers=_moe_layer({
    **_experts("mlp", "gate", "gate_proj", "up_proj", "down_proj"), **_QWEN_SHARED}))  # fmt: skip
GEMMA3_MULTIMODAL = dataclasses.replace(LLAMA, prefixes=("language_model.model.", "model.language_model."))


def prefix_for(config: ModelConfig, names: Collection[str]) -> str:
    """The prefix of this checkpoint's decoder tensors: the first of the family's prefixes under which its
    embedding is stored (checkpoints of a bare decoder, `LlamaModel`, carry none); the first prefix when none is."""
    scheme = config.family.names
    embedding = scheme.model[("embedding",)].name
    return next((p for p in scheme.prefixes if p + embedding in names), scheme.prefixes[0])


def tensor_for(config: ModelConfig, path: Sequence, prefix: str) -> Stored:
    """Where the model parameter `path` is stored; a KeyError for a parameter the family's names do not cover."""
    scheme = config.family.names
    key = tuple(path)
    entry, where = scheme.model.get(key), prefix
    if entry is None and len(key) >= 3 and key[0] == "layers":
        entry, where = scheme.layers(config).get(key[2:]), prefix + scheme.layer.format(key[1])
    if entry is None:
        raise KeyError(f"model parameter {'/'.join(map(str, key))} has no {config.model_type} checkpoint tensor")
    experts = config.moe.num_experts if entry.experts and config.moe is not None else 0
    return Stored(where + entry.name, entry.layout, entry.part(config) if entry.part else None, experts)
