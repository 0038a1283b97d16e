"""The decoder's architecture: read once from a checkpoint's `config.json`, exactly as transformers 5.24 reads it
(its config classes' defaults included), then frozen.

Families (`model_type`): `qwen2` (Qwen2, Qwen2.5), `qwen3` (dense Qwen3), `llama` (Llama 2, 3, 3.1, 3.2), `mistral`,
`gemma2` and `gemma3_text` (Gemma 3's text-only checkpoints). They share one decoder (`extract/model.py`); what
differs between them is data in `ModelConfig`, and each family's reading is one short function below (`_qwen2`,
`_llama`, `_gemma2`, ...), next to the table of its transformers defaults (`DEFAULTS`).

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
from extract.rope import Rope, read_layer_type_ropes, read_rope

#: model_type -> what the message calls it. Qwen2.5 checkpoints say "qwen2"; Llama 2 to 3.2 say "llama".
SUPPORTED_MODEL_TYPES = {
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3 dense",
    "llama": "Llama 2, 3, 3.1, 3.2",
    "mistral": "Mistral",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 text-only",
}

#: The defaults of transformers' config classes (Qwen2Config, Qwen3Config, LlamaConfig, MistralConfig, Gemma2Config,
#: Gemma3TextConfig; 5.24) for every field read here; they apply when config.json leaves the field out.
#: `tests/extract_model/test_families.py` checks them against the classes themselves.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_QWEN = dict(zip(_SIZES, (151936, 4096, 22016, 32, 32)), num_key_value_heads=32, hidden_act="silu",
             max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=4096,
             max_window_layers=28, layer_types=None)  # fmt: skip
_GEMMA = dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
              attention_bias=False, sliding_window=4096, query_pre_attn_scalar=256, layer_types=None)  # fmt: skip
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "llama": dict(zip(_SIZES, (32000, 4096, 11008, 32, 32)), num_key_value_heads=None, head_dim=None,
                  hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, attention_bias=False,
                  mlp_bias=False),
    "mistral": dict(zip(_SIZES, (32000, 4096, 14336, 32, 32)), num_key_value_heads=8, head_dim=None,
                    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=4096),
    "gemma2": dict(zip(_SIZES, (256000, 2304, 9216, 26, 8)), **_GEMMA, max_position_embeddings=8192,
                   attn_logit_softcapping=50.0, use_bidirectional_attention=None),
    "gemma3_text": dict(zip(_SIZES, (262208, 2304, 9216, 26, 8)), **_GEMMA, max_position_embeddings=131072,
                        use_bidirectional_attention=False),
}  # fmt: skip

#: Families whose config class types num_key_value_heads `int | None` and reads a null as num_attention_heads
#: (Mistral's and Gemma's refuse a null).
NULLABLE_KV_HEADS = ("qwen2", "qwen3", "llama")
#: transformers' ACT2FN names -> the activation the MLP applies to its gate.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
#: Gemma 3's default local/global pattern: five sliding layers, then a global one (`sliding_window_pattern`).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
#: `Gemma3TextConfig.default_theta`: the global and local RoPE bases.
GEMMA3_THETA = {"full": 1_000_000.0, "sliding": 10_000.0}


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
    rope: Rope  # of full-attention layers (every layer, except where `sliding_rope` is given)
    rms_norm_eps: float
    tie_word_embeddings: bool
    #: per layer: None for full causal attention, or the sliding-window width in tokens.
    sliding_windows: tuple[int | None, ...]
    # -- what differs between families; the defaults are Llama's ---------------------------------------------------
    qkv_bias: bool = False  # Qwen2 always; Qwen3, Llama, Gemma under `attention_bias`
    o_bias: bool = False  # Qwen3, Llama, Gemma under `attention_bias`
    qk_norm: bool = False  # per-head RMSNorm on queries and keys before RoPE (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w) in float32, then casts (Llama: casts, then w)
    sandwich_norms: bool = False  # Gemma: a norm on the attention's and the MLP's output too, before the residual
    embedding_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the compute dtype
    activation: str = "silu"  # of the MLP's gate: "silu", "gelu_tanh" (Gemma's GeGLU) or "gelu"
    query_scale: float = 0.0  # the softmax scale: 1/sqrt(head_dim) (0 here means that), Gemma 1/sqrt(query_pre_attn_scalar)
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

    def layer_rope(self, layer: int) -> Rope:
        """The RoPE of decoder layer `layer` (counted from 0)."""
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

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate a transformers config dict; every problem is a BadInput naming the field and `source`."""
        model_type = raw.get("model_type")
        family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            hint = " (Gemma 3 with vision: its text model is model_type gemma3_text)" if model_type == "gemma3" else ""
            supported = "; ".join(f"{name} ({what})" for name, what in SUPPORTED_MODEL_TYPES.items())
            raise BadInput(
                f"{source}: model_type={model_type!r} is not supported{hint}; supported model_type values are "
                f"{supported}. MoE and multimodal variants are not"
            )
        fields = _Fields(raw, DEFAULTS[model_type], source, model_type)
        hidden, heads = fields.positive("hidden_size"), fields.positive("num_attention_heads")
        kv_heads = fields.positive("num_key_value_heads", null_means=heads if model_type in NULLABLE_KV_HEADS else None)
        if heads % kv_heads:
            raise BadInput(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        common = dict(
            model_type=model_type,
            vocab_size=fields.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.positive("intermediate_size"),
            num_hidden_layers=fields.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=fields.number("rms_norm_eps"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            raw=json.dumps(dict(raw), sort_keys=True),
        )
        specific = family(fields, common)
        if specific["head_dim"] % 2:
            raise BadInput(f"{source}: head_dim={specific['head_dim']} must be even for rotary embeddings")
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


#: The name other modules were written against, when Qwen was the only family.
QwenConfig = ModelConfig


class _Fields:
    """One config.json's fields, with its family's transformers defaults, checked as transformers' strict
    dataclass validation checks them (an int field takes no float or bool, a bool field no string or 1)."""

    def __init__(self, raw: Mapping[str, Any], defaults: Mapping[str, Any], source: str, model_type: str):
        self.raw, self.defaults, self.source, self.model_type = raw, defaults, source, model_type

    def get(self, name: str) -> Any:
        return self.raw.get(name, self.defaults.get(name))

    def bad(self, name: str, problem: str) -> BadInput:
        return BadInput(f"{self.source}: {name}={self.get(name)!r} {problem}")

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


# -- the families ------------------------------------------------------------------------------------------------


def _qwen2(f: _Fields, common: dict) -> dict:
    """Qwen2 / Qwen2.5: biases on q, k and v (never on o); head_dim is hidden / heads unless given."""
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=False)
    return dict(
        head_dim=head_dim, rope=f.rope(head_dim), qkv_bias=True, activation=f.activation("hidden_act"),
        sliding_windows=_qwen_windows(f, common["num_hidden_layers"]),
    )  # fmt: skip


def _qwen3(f: _Fields, common: dict) -> dict:
    """Qwen3: per-head q/k RMSNorm before RoPE; head_dim 128 unless given; biases (q, k, v, o) only under
    attention_bias."""
    head_dim, bias = f.positive("head_dim"), f.flag("attention_bias")
    return dict(
        head_dim=head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, qk_norm=True,
        activation=f.activation("hidden_act"), sliding_windows=_qwen_windows(f, common["num_hidden_layers"]),
    )  # fmt: skip


def _llama(f: _Fields, common: dict) -> dict:
    """Llama 2, 3, 3.1, 3.2 (llama3 RoPE scaling): no biases unless attention_bias; never a window."""
    f.require_divisible_heads(common["hidden_size"], common["num_attention_heads"])
    if f.flag("mlp_bias"):
        raise f.bad("mlp_bias", "is not supported (MLP biases); no released Llama has them")
    head_dim = f.head_dim(common["hidden_size"], common["num_attention_heads"], null_means_divided=True)
    bias = f.flag("attention_bias")
    return dict(
        head_dim=head_dim, rope=f.rope(head_dim), qkv_bias=bias, o_bias=bias, activation=f.activation("hidden_act"),
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
    window = f.get("sliding_window")
    if window is not None:
        window = f.positive("sliding_window")
    return dict(
        head_dim=head_dim, rope=f.rope(head_dim), activation=f.activation("hidden_act"),
        sliding_windows=(window,) * common["num_hidden_layers"],
    )  # fmt: skip


def _gemma(f: _Fields, common: dict, default_layer_types: list[str]) -> dict:
    """What Gemma 2 and Gemma 3 share: pre- and post-norms around attention and MLP with (1 + w) scales, GeGLU with
    the tanh GELU, embeddings times sqrt(hidden_size), logits scaled by 1/sqrt(query_pre_attn_scalar), layer types
    that choose the sliding layers, head_dim 256 unless given."""
    f.require_divisible_heads(common["hidden_size"], common["num_attention_heads"])
    if f.get("use_bidirectional_attention"):
        raise f.bad("use_bidirectional_attention", "is not supported: these are causal language models")
    bias = f.flag("attention_bias")
    return dict(
        head_dim=f.positive("head_dim"), qkv_bias=bias, o_bias=bias, norm_plus_one=True, sandwich_norms=True,
        embedding_scale=True, activation=f.activation("hidden_activation"),
        query_scale=f.positive("query_pre_attn_scalar") ** -0.5,
        sliding_windows=_windows_from_layer_types(f, default_layer_types, f.get("sliding_window"), "sliding_window is null"),
    )  # fmt: skip


def _gemma2(f: _Fields, common: dict) -> dict:
    """Gemma 2: attention logits soft-capped (`attn_logit_softcapping`, 50 unless null); layers alternate sliding
    (even) and global (odd)."""
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(common["num_hidden_layers"])]
    gemma = _gemma(f, common, alternating)
    return dict(gemma, rope=f.rope(gemma["head_dim"]), attention_softcap=f.number("attn_logit_softcapping", nullable=True))


def _gemma3(f: _Fields, common: dict) -> dict:
    """Gemma 3 text: q/k norms; a global RoPE (theta 1e6) and a local one for sliding layers (10000); five sliding
    layers per global one. Its `attn_logit_softcapping` is read by transformers but never applied, so not here
    either."""
    pattern = f.raw.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise BadInput(f"{f.source}: sliding_window_pattern={pattern!r} must be a positive integer")
    five_to_one = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(common["num_hidden_layers"])]
    gemma = _gemma(f, common, five_to_one)
    full, sliding = read_layer_type_ropes(
        f.raw, gemma["head_dim"], f.source, max_position_embeddings=f.defaults["max_position_embeddings"],
        full_theta=GEMMA3_THETA["full"], sliding_theta=GEMMA3_THETA["sliding"],
    )  # fmt: skip
    return dict(gemma, rope=full, sliding_rope=sliding, qk_norm=True)


_FAMILIES: dict[str, Callable[[_Fields, dict], dict]] = {
    "qwen2": _qwen2, "qwen3": _qwen3, "llama": _llama, "mistral": _mistral, "gemma2": _gemma2, "gemma3_text": _gemma3,
}  # fmt: skip


# -- sliding windows ---------------------------------------------------------------------------------------------


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


def normalize_sites(sites: Mapping[str, Sequence[int]] | None, num_hidden_layers: int) -> tuple[HookPoint, ...]:
    """{site: [decoder layers from 0; negatives count back, -1 the last]} -> sorted, de-duplicated hook points."""
    if sites is None:
        return ()
    if not isinstance(sites, Mapping):
        raise BadInput(f"sites={sites!r} must map site names to layer lists, e.g. {{\"mlp_out\": [3, 7]}}")
    points = set()
    for site, layers in sites.items():
        if site not in SITES:
            raise BadInput(f"sites: {site!r} is not a hook site; use one of {', '.join(SITES)}")
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
