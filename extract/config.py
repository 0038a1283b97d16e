"""The decoder's architecture (`ModelConfig`): read once from a checkpoint's `config.json`, exactly as transformers
5.24 reads it (its config classes' defaults included), then frozen.

Each family is one entry of `extract.families.FAMILIES` (its reader, tensor names, hook sites and planning figures);
what differs between the families is data here (where the norms sit, which norm, the MLP's kind, how positions
enter, ...), read by the one decoder (`extract/model.py`).

Both the transformers v4 spelling (`rope_theta`, `rope_scaling`, `use_sliding_window` + `max_window_layers`) and the
v5 spelling (`rope_parameters`, `layer_types`) are understood, because hub checkpoints carry the former and
checkpoints saved by a current transformers carry the latter (RoPE: `extract/rope.py`). Whatever transformers would
read differently from us, or fails on, is a `BadInput` (exit 65) naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from activations.format import ROUTER_SITES, SITES, HookPoint, Output, output_order
from extract.errors import BadInput
from extract.experts import Moe
from extract.families import FAMILIES, Family
from extract.rope import Rope

#: Where a decoder layer's norms sit around its two sublayers, as the model's norm modules of each placement:
#: `before` (pre-norms: GPT-2, NeoX, Llama, Qwen, Phi-3, Gemma 1), `around` (pre- and post-norms: Gemma 2 and 3),
#: `after` (post-norms only, the sublayers read the residual stream itself: OLMo 2). The layer builds these norms,
#: `extract/names.py` names their tensors, and the memory model counts them from the built model.
NORM_POSITIONS = {
    "before": ("attention_norm", "mlp_norm"),
    "around": ("attention_norm", "attention_out_norm", "mlp_norm", "mlp_out_norm"),
    "after": ("attention_out_norm", "mlp_out_norm"),
}
#: How a norm computes (`extract.model.Norm`), each as its family's reference does in a narrow dtype:
#: `rms`: normalise in float32, cast, then times w (Llama's order); `rms_scale_in_float32`: times w in float32, then
#: cast (OLMo 2); `rms_one_plus`: times (1 + w) in float32, then cast (Gemma); `layer_norm`: LayerNorm with a bias,
#: in float32, cast once (GPT-2, NeoX).
NORMS = ("rms", "rms_scale_in_float32", "rms_one_plus", "layer_norm")
#: The MLP: `gated` is down(act(gate x) * up x) (SwiGLU, GeGLU); `plain` is down(act(up x + b)) + b (GPT-2, NeoX).
MLPS = ("gated", "plain")

#: Mixtures of experts (and their kin) that are still refused, with what they need beyond the supported families,
#: as their transformers 5.24 modeling files compute it: named in the refusal, read from config.json alone.
UNSUPPORTED = {
    "deepseek_v2": "multi-head latent attention (q_lora_rank, kv_lora_rank) and group-limited expert routing "
                   "(n_group, topk_group)",
    "deepseek_v3": "multi-head latent attention (q_lora_rank, kv_lora_rank) and sigmoid expert routing with a "
                   "score-correction bias, group-limited (n_group, topk_group)",
    "gpt_oss": "attention sinks (a learned logit per head in every softmax) and experts with biases and a clamped "
               "SwiGLU (swiglu_limit)",
    "glm4_moe": "sigmoid expert routing with a score-correction bias, group-limited (n_group, topk_group)",
    "phimoe": "sparsemixer routing",
    "qwen3_next": "gated DeltaNet linear-attention layers and gated attention",
    "dbrx": "its fused expert tensors and clipped q/k/v (clip_qkv)",
    "jamba": "Mamba layers",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs; sizes come from the checkpoint, never from presets."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: Rope | None  # of full-attention layers (every layer, except where `sliding_rope` is given); None: no RoPE
    norm_eps: float
    tie_word_embeddings: bool
    #: per layer: None for full causal attention, or the sliding-window width in tokens.
    sliding_windows: tuple[int | None, ...]
    # -- what differs between families; the defaults are Llama's ---------------------------------------------------
    norm: str = "rms"  # NORMS
    norm_position: str = "before"  # NORM_POSITIONS
    parallel_residual: bool = False  # NeoX: resid_post = resid_pre + attn(norm x) + mlp(norm x); no resid_mid
    mlp: str = "gated"  # MLPS
    activation: str = "silu"  # of the MLP's gate (or its one up-projection): "silu", "gelu_tanh" or "gelu"
    qkv_bias: bool = False  # Qwen2, GPT-2, NeoX always; others under `attention_bias`
    o_bias: bool = False
    mlp_bias: bool = False  # GPT-2, NeoX: on the up- and down-projections
    #: q/k norms before RoPE: "head" (per head: Qwen3, Gemma 3) or "projection" (over all heads at once: OLMo 2).
    qk_norm: str | None = None
    position_table: int = 0  # GPT-2: rows of the learned absolute-position table added to the embeddings (0: none)
    embedding_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the compute dtype
    query_scale: float = 0.0  # the softmax scale: 1/sqrt(head_dim) (0 means that), Gemma 1/sqrt(query_pre_attn_scalar)
    attention_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    sliding_rope: Rope | None = None  # Gemma 3: the sliding layers' own RoPE (local base frequency)
    moe: Moe | None = None  # Mixtral, Qwen-MoE, OLMoE: the mixture of experts (extract/experts.py); None: dense
    #: config.json as read (for `to_dict`); not part of the architecture's identity.
    raw: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.query_scale:
            object.__setattr__(self, "query_scale", self.head_dim**-0.5)

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """The norm modules of every decoder layer (`NORM_POSITIONS`)."""
        return NORM_POSITIONS[self.norm_position]

    @property
    def family(self) -> Family:
        """This model's entry in the family registry (`extract.families.FAMILIES`)."""
        return FAMILIES[self.model_type]

    @property
    def sites(self) -> tuple[str, ...]:
        """The hook sites some layer of this model has (`Family.sites` of each layer), in SITES order."""
        present = {site for layer in range(self.num_hidden_layers) for site in self.layer_sites(layer)}
        return tuple(site for site in SITES if site in present)

    def layer_sites(self, layer: int) -> tuple[str, ...]:
        """The hook sites decoder layer `layer` has (`Family.sites`)."""
        return self.family.sites(self, layer)

    def moe_layer(self, layer: int) -> Moe | None:
        """The mixture of experts of decoder layer `layer`; None where its MLP is dense."""
        return self.moe if self.moe is not None and self.moe.sparse_layers[layer] else None

    @property
    def mlp_projections(self) -> int:
        """Weight matrices of the MLP, each hidden_size x intermediate_size: 3 gated (gate, up, down), 2 plain."""
        return 3 if self.mlp == "gated" else 2

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model computes as transformers does: GPT-2's position table, LongRoPE's
        pretraining length (past it transformers switches frequencies); None where there is no such limit."""
        limits = [r.max_positions for r in (self.rope, self.sliding_rope) if r is not None and r.max_positions]
        return min([*limits, *([self.position_table] if self.position_table else [])], default=None)

    def layer_rope(self, layer: int) -> Rope | None:
        """The RoPE of decoder layer `layer` (counted from 0); None for a model without RoPE."""
        if self.sliding_rope is not None and self.sliding_windows[layer] is not None:
            return self.sliding_rope
        return self.rope

    def width(self, output: Output) -> int:
        """Values per token of one output: intermediate_size for the MLP's hidden activations, num_experts for the
        router's logits and weights, num_experts_per_tok for the chosen experts' indices, else hidden_size."""
        if isinstance(output, HookPoint) and output.site == "mlp_hidden":
            return self.intermediate_size
        if isinstance(output, HookPoint) and output.site == "expert_indices" and self.moe is not None:
            return self.moe.top_k
        if isinstance(output, HookPoint) and output.site in ROUTER_SITES and self.moe is not None:
            return self.moe.num_experts
        return self.hidden_size

    def hidden_units(self, outputs: Sequence[Output]) -> float:
        """The outputs' values per token in units of hidden_size: what the memory model's `kept` counts
        (`mlp_hidden` counts intermediate_size / hidden_size)."""
        return sum(map(self.width, outputs)) / self.hidden_size

    def depth_for(self, outputs: Sequence[Output]) -> int:
        """Decoder layers to compute for `outputs`: hidden state i needs i (the final-norm index all of them), a hook
        point in layer l needs l + 1, except `resid_pre`, which is the input of layer l."""
        depth = 0
        for output in outputs:
            if isinstance(output, HookPoint):
                depth = max(depth, output.layer + (output.site != "resid_pre"))
            else:
                depth = max(depth, output)
        return min(depth, self.num_hidden_layers)

    def hook_points(self, sites: Mapping[str, Sequence[int]] | None) -> tuple[HookPoint, ...]:
        """A job's `sites` as sorted hook points (`normalize_sites`), refusing a site this family does not have, and
        a site of a layer that lacks it (a router site of a dense layer, `mlp_hidden` of a mixture of experts)."""
        points = normalize_sites(sites, self.num_hidden_layers, defined=self.sites, family=self.model_type)
        for point in points:
            if point.site not in self.layer_sites(point.layer):
                sparse = [i for i in range(self.num_hidden_layers) if self.moe_layer(i)]
                why = ("its MLP is dense (mixture-of-experts layers: " + ", ".join(map(str, sparse)) + ")"
                       if point.site in ROUTER_SITES else "its MLP is a mixture of experts, with no one hidden "
                       "activation; keep mlp_out (the block's output) or the router's sites")  # fmt: skip
                raise BadInput(f"sites.{point.site}: layer {point.layer} has no {point.site}: {why}")
        return points

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate a transformers config dict; every problem is a BadInput naming the field and `source`."""
        model_type = raw.get("model_type")
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            supported = "; ".join(f"{name} ({family.name})" for name, family in FAMILIES.items())
            missing = f" (it needs {UNSUPPORTED[model_type]}, which is not implemented)" if model_type in UNSUPPORTED else ""
            raise BadInput(
                f"{source}: model_type={model_type!r} is not supported{missing}; supported model_type values are "
                f"{supported}"
            )
        text, text_source = family.language_model(raw, source)
        fields = family.fields(text, text_source, model_type)
        hidden, heads = fields.positive("hidden_size"), fields.positive("num_attention_heads")
        common = dict(
            model_type=model_type,
            vocab_size=fields.positive("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=fields.positive("num_hidden_layers"),
            num_attention_heads=heads,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            raw=json.dumps(dict(raw), sort_keys=True),
        )
        specific = family.read(fields, common)
        if heads % specific["num_key_value_heads"]:
            raise BadInput(
                f"{text_source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={specific['num_key_value_heads']}"
            )
        if specific["head_dim"] % 2 and specific.get("rope") is not None:
            raise BadInput(f"{text_source}: head_dim={specific['head_dim']} must be even for rotary embeddings")
        return cls(**common, **specific)

    @classmethod
    def from_file(cls, path: pathlib.Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadInput(f"model config {path} does not exist; the model directory must hold config.json") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadInput(f"model config {path} is not readable JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise BadInput(f"model config {path} must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The config.json this was read from (used to mirror random benchmark models)."""
        if not self.raw:
            raise ValueError("this ModelConfig was not read from a config dict; build it with ModelConfig.from_dict")
        return json.loads(self.raw)



# -- what a job keeps --------------------------------------------------------------------------------------------


def normalize_sites(
    sites: Mapping[str, Sequence[int]] | None,
    num_hidden_layers: int,
    *,
    defined: Sequence[str] = SITES,
    family: str | None = None,
) -> tuple[HookPoint, ...]:
    """{site: [decoder layers from 0; negatives count back, -1 the last]} -> sorted, de-duplicated hook points.

    `defined` are the sites the model's family has (`ModelConfig.sites`); a known site outside them is refused,
    naming the family (`family`)."""
    if sites is None:
        return ()
    if not isinstance(sites, Mapping):
        raise BadInput(f"sites={sites!r} must map site names to layer lists, e.g. {{\"mlp_out\": [3, 7]}}")
    points = set()
    for site, layers in sites.items():
        if site not in SITES:
            raise BadInput(f"sites: {site!r} is not a hook site; use one of {', '.join(defined)}")
        if site not in defined:
            raise BadInput(
                f"sites: {site!r} is not a hook site of {family or 'this model'}: its attention and MLP both read the "
                f"layer's input and add to it at once, so no residual stream lies between them; use one of "
                f"{', '.join(defined)}"
            )
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
            raise BadInput(f"sites.{site}: {layers!r} must be a non-empty list of decoder layers, e.g. [3, 7]")
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise BadInput(f"sites.{site}: {layer!r} is not an integer layer")
            if not -num_hidden_layers <= layer < num_hidden_layers:
                raise BadInput(
                    f"sites.{site}: layer {layer} is out of range for a model with num_hidden_layers="
                    f"{num_hidden_layers}: use 0..{num_hidden_layers - 1} (decoder layers, from 0) or "
                    f"-{num_hidden_layers}..-1"
                )
            points.add(HookPoint(site, layer % num_hidden_layers))
    return tuple(sorted(points, key=output_order))

