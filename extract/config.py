"""The decoder's architecture: read once from a checkpoint's `config.json`, exactly as transformers 5.24 reads it
(its config classes' defaults included), then frozen.

Families (`model_type`, `FAMILIES`): GPT-2, GPT-NeoX (Pythia), Llama 2/3, Mistral, Qwen2/2.5/3, Phi-3 (and Phi-4-mini),
OLMo 2, Gemma 1/2/3 (Gemma 3's text-only checkpoints and the language model of its multimodal ones). They share one
decoder (`extract/model.py`); what differs between them is data in `ModelConfig` (where the norms sit, which norm,
the MLP's kind, how positions enter, ...), and each family's reading is one short function below (`_gpt2`,
`_llama`, `_gemma2`, ...), next to the table of its transformers defaults (`DEFAULTS`). Adding a family is such a
function and its `Family` entry here, its tensor names in `extract/names.py`, and its parity test
(`tests/extract_model/test_family_parity.py`).

Both the transformers v4 spelling (`rope_theta`, `rope_scaling`, `use_sliding_window` + `max_window_layers`) and the
v5 spelling (`rope_parameters`, `layer_types`) are understood, because hub checkpoints carry the former and
checkpoints saved by a current transformers carry the latter (RoPE: `extract/rope.py`). Whatever transformers would
read differently from us, or fails on, is a `BadInput` (exit 65) naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from activations.format import SITES, HookPoint, Output, output_order
from extract.errors import BadInput
from extract.rope import DEFAULT_THETA, Rope, one_block, read_layer_type_ropes, read_rope, resolve_block

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


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`: what messages call it, transformers' config class defaults for the fields read (`DEFAULTS`),
    its reader, and transformers' `attribute_map` (our field name -> the name its config.json may use instead)."""

    name: str
    defaults: Mapping[str, Any]
    read: Callable[[_Fields, dict], dict]
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: transformers types num_key_value_heads `int | None` and reads a null as num_attention_heads.
    nullable_kv_heads: bool = False


#: transformers' ACT2FN names -> the activation the MLP applies (`extract.model.ACTIVATIONS`).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
#: Gemma 3's default local/global pattern: five sliding layers, then a global one (`sliding_window_pattern`).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
#: `Gemma3TextConfig.default_theta`: the global and local RoPE bases.
GEMMA3_THETA = {"full": 1_000_000.0, "sliding": 10_000.0}
#: GPT-NeoX's RoPE when its config leaves it out (`GPTNeoXConfig.convert_rope_params_to_dict`): `rotary_pct`,
#: `rotary_emb_base`.
NEOX_ROTARY_PCT, NEOX_ROTARY_BASE = 0.25, 10_000.0


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
    def sites(self) -> tuple[str, ...]:
        """The hook sites a layer of this family has: all of SITES, but `resid_mid` where attention and MLP run in
        parallel (NeoX), since no residual stream lies between them."""
        return tuple(s for s in SITES if not (self.parallel_residual and s == "resid_mid"))

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
        """Values per token of one output: intermediate_size for the MLP's hidden activations, else hidden_size."""
        if isinstance(output, HookPoint) and output.site == "mlp_hidden":
            return self.intermediate_size
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
        """A job's `sites` as sorted hook points (`normalize_sites`), refusing a site this family does not have."""
        return normalize_sites(sites, self.num_hidden_layers, defined=self.sites, family=self.model_type)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate a transformers config dict; every problem is a BadInput naming the field and `source`."""
        model_type = raw.get("model_type")
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            supported = "; ".join(f"{name} ({family.name})" for name, family in FAMILIES.items())
            raise BadInput(
                f"{source}: model_type={model_type!r} is not supported; supported model_type values are "
                f"{supported}. MoE variants are not"
            )
        text, text_source = raw, source
        if model_type == "gemma3":  # multimodal: the language model's config is its text_config
            text, text_source = _text_config(raw, source)
        fields = _Fields(text, family, text_source, model_type)
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


def _text_config(raw: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], str]:
    """A multimodal Gemma 3's language model config: its `text_config` (Gemma3Config builds a Gemma3TextConfig from
    it, defaults included; absent or null is all defaults)."""
    text = raw.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, Mapping):
        raise BadInput(f"{source}: text_config must be a JSON object (the language model's config)")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise BadInput(f"{source}: text_config.model_type={text.get('model_type')!r} must be gemma3_text")
    return text, f"{source} text_config"


class _Fields:
    """One config.json's fields, with its family's transformers defaults, checked as transformers' strict
    dataclass validation checks them (an int field takes no float or bool, a bool field no string or 1)."""

    def __init__(self, raw: Mapping[str, Any], family: Family, source: str, model_type: str):
        self.raw, self.family, self.source, self.model_type = raw, family, source, model_type
        self.defaults = family.defaults

    def key(self, name: str) -> str:
        """The config.json key that holds `name`: the name itself wins over the family's alias (GPT-2's n_embd)."""
        alias = self.family.aliases.get(name)
        return alias if alias is not None and name not in self.raw and alias in self.raw else name

    def get(self, name: str) -> Any:
        key = self.key(name)
        return self.raw[key] if key in self.raw else self.defaults.get(self.family.aliases.get(name, name))

    def given(self, name: str) -> bool:
        return self.key(name) in self.raw

    def bad(self, name: str, problem: str) -> BadInput:
        return BadInput(f"{self.source}: {self.key(name)}={self.get(name)!r} {problem}")

    def positive(self, name: str, *, null_means: int | None = None) -> int:
        """A positive integer; `null_means` is what an explicit null reads as where transformers allows one."""
        value = self.get(name)
        if value is None and null_means is not None:
            return null_means
        if value is None:
            raise self.bad(name, f"must be a positive integer (a {self.model_type} config cannot leave it null)")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.bad(name, "must be a positive integer")
        return value

    def number(self, name: str, *, nullable: bool = False) -> float | None:
        value = self.get(name)
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.bad(name, "must be a positive number" + (" or null" if nullable else ""))
        return float(value)

    def flag(self, name: str) -> bool:
        value = self.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.bad(name, "must be true or false (transformers refuses a string or a number here too)")
        return value

    def activation(self, name: str) -> str:
        value = self.get(name)
        if value not in ACTIVATIONS:
            raise self.bad(name, f"is not supported; supported: {', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[value]

    def kv_heads(self, heads: int) -> int:
        """`num_key_value_heads`, a null being the query heads where the family's config class allows it."""
        return self.positive("num_key_value_heads", null_means=heads if self.family.nullable_kv_heads else None)

    def head_dim(self, hidden: int, heads: int, *, null_means_divided: bool) -> int:
        """`head_dim`, or hidden_size / num_attention_heads where the family derives it: when absent, and when null
        if `null_means_divided` (else a null is refused, as transformers fails on it)."""
        if "head_dim" not in self.raw or (self.raw["head_dim"] is None and null_means_divided):
            if hidden % heads:
                raise BadInput(
                    f"{self.source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                    "and head_dim is not given"
                )
            return hidden // heads
        return self.positive("head_dim")

    def divided_head_dim(self, hidden: int, heads: int) -> int:
        """hidden_size / num_attention_heads, which GPT-2's and NeoX's attention always use (a `head_dim` in
        config.json is not read by their attention)."""
        self.require_divisible_heads(hidden, heads)
        return hidden // heads

    def rope(self, head_dim: int) -> Rope:
        return read_rope(
            self.raw, head_dim, self.source, max_position_embeddings=self.defaults["max_position_embeddings"]
        )

    def require_divisible_heads(self, hidden: int, heads: int) -> None:
        """Llama's and Gemma's `validate_architecture`: hidden_size divides by the heads, whatever head_dim is."""
        if hidden % heads:
            raise BadInput(
                f"{self.source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                f"(transformers refuses such a {self.model_type} config)"
            )

    def refuse_ignored(self, name: str, used: Any, why: str) -> None:
        """A field transformers ignores for this family: refused when given and different from what is used."""
        if name in self.raw and self.raw[name] != used:
            raise BadInput(f"{self.source}: {name}={self.raw[name]!r} is ignored by transformers for "
                           f"{self.model_type} ({why}); remove it")  # fmt: skip


def _decoder(f: _Fields, common: dict, head_dim: int, **rest) -> dict:
    """What the Llama-like families read alike: the MLP's width, the key/value heads and the RMSNorm's epsilon."""
    return dict(intermediate_size=f.positive("intermediate_size"), num_key_value_heads=f.kv_heads(
        common["num_attention_heads"]), head_dim=head_dim, norm_eps=f.number("rms_norm_eps"), **rest)  # fmt: skip


# -- the families ------------------------------------------------------------------------------------------------


def _gpt2(f: _Fields, common: dict) -> dict:
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


def _gpt_neox(f: _Fields, common: dict) -> dict:
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


def _qwen2(f: _Fields, common: dict) -> dict:
    """Qwen2 / Qwen2.5: biases on q, k and v (never on o); head_dim is hidden / heads unless given."""
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    return _decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=True, activation=f.activation("hidden_act"),
        sliding_windows=_qwen_windows(f, common["num_hidden_layers"]),
    )  # fmt: skip


def _qwen3(f: _Fields, common: dict) -> dict:
    """Qwen3: per-head q/k RMSNorm before RoPE; head_dim 128 unless given; biases (q, k, v, o) only under
    attention_bias."""
    head_dim, bias = f.positive("head_dim"), f.flag("attention_bias")
    return _decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, qk_norm="head",
        activation=f.activation("hidden_act"), sliding_windows=_qwen_windows(f, common["num_hidden_layers"]),
    )  # fmt: skip


def _llama(f: _Fields, common: dict) -> dict:
    """Llama 2, 3, 3.1, 3.2 (llama3 RoPE scaling): no biases unless attention_bias; never a window."""
    f.require_divisible_heads(common["hidden_size"], common["num_attention_heads"])
    if f.flag("mlp_bias"):
        raise f.bad("mlp_bias", "is not supported (MLP biases); no released Llama has them")
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=True)
    bias = f.flag("attention_bias")
    return _decoder(
        f, common, head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, activation=f.activation("hidden_act"),
        sliding_windows=(None,) * common["num_hidden_layers"],
    )  # fmt: skip


def _mistral(f: _Fields, common: dict) -> dict:
    """Mistral: no biases; every layer slides over `sliding_window` (4096 when absent, no window when null)."""
    if "layer_types" in f.raw:
        raise BadInput(
            f"{f.source}: layer_types is given, but transformers' MistralModel ignores it and slides every layer "
            "(it warns: use a Ministral model type); remove layer_types, or set sliding_window null for none"
        )
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=True)
    return _decoder(
        f, common, head_dim, rope=f.rope(head_dim), activation=f.activation("hidden_act"),
        sliding_windows=(_window(f),) * common["num_hidden_layers"],
    )  # fmt: skip


def _phi3(f: _Fields, common: dict) -> dict:
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
    return _decoder(
        f, common, head_dim, rope=rope, activation=f.activation("hidden_act"),
        sliding_windows=(_window(f),) * common["num_hidden_layers"],
    )  # fmt: skip


def _olmo2(f: _Fields, common: dict) -> dict:
    """OLMo 2: norms only after the sublayers (the attention and the MLP read the residual stream itself), RMSNorm
    scaled in float32, q/k RMSNorm over the whole projection (all heads at once) before RoPE; biases on q, k, v, o
    only under attention_bias."""
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    bias = f.flag("attention_bias")
    return _decoder(
        f, common, head_dim, rope=f.rope(head_dim), norm="rms_scale_in_float32", norm_position="after",
        qk_norm="projection", qkv_bias=bias, o_bias=bias, activation=f.activation("hidden_act"),
        sliding_windows=(None,) * common["num_hidden_layers"],
    )  # fmt: skip


def _gemma_common(f: _Fields, common: dict, activation: str) -> dict:
    """What every Gemma shares: (1 + w) RMSNorms, GeGLU, embeddings times sqrt(hidden_size), head_dim 256 unless
    given, no bidirectional attention."""
    f.require_divisible_heads(common["hidden_size"], common["num_attention_heads"])
    if f.get("use_bidirectional_attention"):
        raise f.bad("use_bidirectional_attention", "is not supported: these are causal language models")
    bias = f.flag("attention_bias")
    return _decoder(
        f, common, f.positive("head_dim"), qkv_bias=bias, o_bias=bias, norm="rms_one_plus", embedding_scale=True,
        activation=activation,
    )  # fmt: skip


def _gemma(f: _Fields, common: dict) -> dict:
    """Gemma 1: pre-norms only; no window; `hidden_act` "gelu" means the tanh approximation, as transformers'
    GemmaConfig rewrites it."""
    activation = "gelu_tanh" if f.get("hidden_act") == "gelu" else f.activation("hidden_act")
    gemma = _gemma_common(f, common, activation)
    return dict(gemma, rope=f.rope(gemma["head_dim"]), sliding_windows=(None,) * common["num_hidden_layers"])


def _gemma2_like(f: _Fields, common: dict, default_layer_types: list[str]) -> dict:
    """What Gemma 2 and Gemma 3 share: pre- and post-norms around attention and MLP, the tanh GELU, logits scaled by
    1/sqrt(query_pre_attn_scalar), layer types that choose the sliding layers."""
    return dict(
        _gemma_common(f, common, f.activation("hidden_activation")), norm_position="around",
        query_scale=f.positive("query_pre_attn_scalar") ** -0.5,
        sliding_windows=_windows_from_layer_types(f, default_layer_types, f.get("sliding_window"), "sliding_window is null"),
    )  # fmt: skip


def _gemma2(f: _Fields, common: dict) -> dict:
    """Gemma 2: attention logits soft-capped (`attn_logit_softcapping`, 50 unless null); layers alternate sliding
    (even) and global (odd)."""
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(common["num_hidden_layers"])]
    gemma = _gemma2_like(f, common, alternating)
    return dict(gemma, rope=f.rope(gemma["head_dim"]), attention_softcap=f.number("attn_logit_softcapping", nullable=True))


def _gemma3(f: _Fields, common: dict) -> dict:
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
}  # fmt: skip

#: model_type -> its family. Qwen2.5 checkpoints say "qwen2"; Llama 2 to 3.2 say "llama"; Pythia "gpt_neox";
#: Phi-3.5 and Phi-4-mini "phi3".
FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT-2", DEFAULTS["gpt2"], _gpt2, aliases={
        "hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions"}),
    "gpt_neox": Family("GPT-NeoX, Pythia", DEFAULTS["gpt_neox"], _gpt_neox),
    "llama": Family("Llama 2, 3, 3.1, 3.2", DEFAULTS["llama"], _llama, nullable_kv_heads=True),
    "mistral": Family("Mistral", DEFAULTS["mistral"], _mistral),
    "qwen2": Family("Qwen2, Qwen2.5", DEFAULTS["qwen2"], _qwen2, nullable_kv_heads=True),
    "qwen3": Family("Qwen3 dense", DEFAULTS["qwen3"], _qwen3, nullable_kv_heads=True),
    "phi3": Family("Phi-3, Phi-3.5, Phi-4-mini", DEFAULTS["phi3"], _phi3, nullable_kv_heads=True),
    "olmo2": Family("OLMo 2", DEFAULTS["olmo2"], _olmo2, nullable_kv_heads=True),
    "gemma": Family("Gemma 1", DEFAULTS["gemma"], _gemma),
    "gemma2": Family("Gemma 2", DEFAULTS["gemma2"], _gemma2),
    "gemma3_text": Family("Gemma 3 text-only", DEFAULTS["gemma3_text"], _gemma3),
    "gemma3": Family("Gemma 3 multimodal, its language model", DEFAULTS["gemma3"], _gemma3),
}  # fmt: skip


# -- sliding windows ---------------------------------------------------------------------------------------------


def _window(f: _Fields) -> int | None:
    """Mistral's and Phi-3's one window for every layer: `sliding_window`, null for none."""
    window = f.get("sliding_window")
    return None if window is None else f.positive("sliding_window")


def _qwen_windows(f: _Fields, num_layers: int) -> tuple[int | None, ...]:
    # transformers' Qwen2Config/Qwen3Config.__post_init__: the window exists only under use_sliding_window (a bool);
    # there an absent sliding_window is 4096 and an explicit null means no window. Without layer_types, layers from
    # max_window_layers on slide (28 when absent), and only when there is a window.
    window = f.get("sliding_window") if f.flag("use_sliding_window") else None
    if f.get("layer_types") is not None:
        off = "sliding_window is null" if f.get("use_sliding_window") else "use_sliding_window is not true"
        return _windows_from_layer_types(f, [], window, off)
    first_sliding = f.get("max_window_layers")
    if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
        raise f.bad("max_window_layers", "must be a non-negative integer")
    return _checked_windows(f, [window is not None and i >= first_sliding for i in range(num_layers)], window)


def _windows_from_layer_types(f: _Fields, default: list[str], window: Any, why_no_window: str) -> tuple[int | None, ...]:
    """v5 `layer_types` (or the family's default list) -> each layer's window."""
    num_layers = f.positive("num_hidden_layers")
    layer_types = default if f.get("layer_types") is None else f.get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise BadInput(
            f"{f.source}: layer_types must list 'full_attention' or 'sliding_attention' once per layer ({num_layers})"
        )
    # "attention" is transformers' legacy name for a full-attention layer (remap_legacy_layer_types).
    layer_types = ["full_attention" if t == "attention" else t for t in layer_types]
    unknown = sorted({str(t) for t in layer_types} - {"full_attention", "sliding_attention"})
    if unknown:
        raise BadInput(
            f"{f.source}: layer_types holds {', '.join(unknown)}; {f.model_type} layers are 'full_attention' or "
            "'sliding_attention'"
        )
    if window is None and "sliding_attention" in layer_types:
        raise BadInput(
            f"{f.source}: layer_types marks layer {layer_types.index('sliding_attention')} 'sliding_attention' but "
            f"{why_no_window}, so it has no window (transformers fails on this config too); set a window, or mark "
            "the layer 'full_attention'"
        )
    return _checked_windows(f, [t == "sliding_attention" for t in layer_types], window)


def _checked_windows(f: _Fields, sliding: list[bool], window: Any) -> tuple[int | None, ...]:
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise BadInput(
            f"{f.source}: sliding layers need a window, but sliding_window={window!r} is not a positive integer "
            "(null means no window)"
        )
    return tuple(window if slides else None for slides in sliding)


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
