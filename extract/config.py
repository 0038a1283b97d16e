"""The Qwen architecture description: read once from a checkpoint's `config.json`, then frozen.

Both the transformers v4 spelling (`rope_theta`, `rope_scaling`, `use_sliding_window` + `max_window_layers`) and the
v5 spelling (`rope_parameters`, `layer_types`) are understood, because hub checkpoints carry the former and
checkpoints saved by a current transformers carry the latter. Every field is read as transformers 5.23 reads it,
defaults included (RoPE: `extract/rope.py`); what transformers would read differently from us, or fail on, is a
`BadInput` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from extract.errors import BadInput
from extract.rope import Rope, read_rope

#: model_type -> architecture family. Qwen2.5 checkpoints say "qwen2".
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
#: transformers' Qwen2Config/Qwen3Config defaults, which apply when config.json leaves the field out.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Everything the forward pass needs; sizes come from the checkpoint, never from presets."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: Rope
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Qwen3: `attention_bias`
    o_bias: bool  # Qwen2: never; Qwen3: `attention_bias`
    qk_norm: bool  # Qwen3's per-head RMSNorm on queries and keys before RoPE
    #: per layer: None for full causal attention, or the sliding-window width in tokens.
    sliding_windows: tuple[int | None, ...]

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> QwenConfig:
        """Validate a transformers config dict; every problem is a BadInput naming the field and `source`."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise BadInput(
                f"{source}: model_type={model_type!r} is not supported; supported model_type values are "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2, Qwen2.5, Qwen3 dense checkpoints)"
            )

        def field(name: str, kind: type, default: Any = None) -> Any:
            value = raw.get(name, default)
            if value is None:
                raise BadInput(f"{source}: field {name!r} is missing; a {model_type} config.json must set it")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise BadInput(f"{source}: field {name!r}={value!r} must be a positive integer")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise BadInput(f"{source}: field {name!r}={value!r} must be a positive number")
            return kind(value)

        hidden_size = field("hidden_size", int)
        num_layers = field("num_hidden_layers", int)
        num_heads = field("num_attention_heads", int)
        num_kv_heads = field("num_key_value_heads", int, num_heads)
        if num_heads % num_kv_heads:
            raise BadInput(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads:
                raise BadInput(
                    f"{source}: hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads} "
                    "and head_dim is not given"
                )
            head_dim = hidden_size // num_heads
        head_dim = field("head_dim", int, head_dim)
        if head_dim % 2:
            raise BadInput(f"{source}: head_dim={head_dim} must be even for rotary embeddings")

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise BadInput(f"{source}: hidden_act={act!r} is not supported; Qwen models use 'silu'")

        rope = read_rope(raw, head_dim, source)
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=field("vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=field("intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rope=rope,
            rms_norm_eps=field("rms_norm_eps", float, 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows(raw, num_layers, source),
        )

    @classmethod
    def from_file(cls, path: pathlib.Path) -> QwenConfig:
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
        """A transformers-style config.json for this architecture (used to mirror random benchmark models)."""
        windows = [w for w in self.sliding_windows if w is not None]
        return {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": dict(self.rope.parameters),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias if self.model_type == "qwen3" else False,
            "hidden_act": "silu",
            "use_sliding_window": bool(windows),
            "sliding_window": windows[0] if windows else None,
            "layer_types": ["full_attention" if w is None else "sliding_attention" for w in self.sliding_windows],
        }


def _sliding_windows(raw: Mapping[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    # transformers' Qwen2Config/Qwen3Config.__post_init__ (5.23): the window exists only under use_sliding_window;
    # there an absent sliding_window is 4096 and an explicit null means no window. Without layer_types, layers from
    # max_window_layers on slide (28 when absent), and only when there is a window.
    window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW) if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first_sliding = raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
            raise BadInput(f"{source}: max_window_layers={first_sliding!r} must be a non-negative integer")
        sliding = [window is not None and i >= first_sliding for i in range(num_layers)]
    else:
        sliding = _sliding_layer_types(raw, layer_types, window, num_layers, source)
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise BadInput(
            f"{source}: use_sliding_window is true but sliding_window={window!r} is not a positive integer "
            "(null means no window)"
        )
    return tuple(window if slides else None for slides in sliding)


def _sliding_layer_types(
    raw: Mapping[str, Any], layer_types: Any, window: Any, num_layers: int, source: str
) -> list[bool]:
    """v5 `layer_types`: which layers slide."""
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise BadInput(
            f"{source}: layer_types must list 'full_attention' or 'sliding_attention' once per layer ({num_layers})"
        )
    # "attention" is transformers' legacy name for a full-attention layer (remap_legacy_layer_types).
    layer_types = ["full_attention" if t == "attention" else t for t in layer_types]
    unknown = sorted({str(t) for t in layer_types} - {"full_attention", "sliding_attention"})
    if unknown:
        raise BadInput(
            f"{source}: layer_types holds {', '.join(unknown)}; Qwen2/Qwen3 layers are 'full_attention' or "
            "'sliding_attention'"
        )
    if window is None and "sliding_attention" in layer_types:
        off = "sliding_window is null" if raw.get("use_sliding_window") else "use_sliding_window is not true"
        raise BadInput(
            f"{source}: layer_types marks layer {layer_types.index('sliding_attention')} 'sliding_attention' but "
            f"{off}, so it has no window (transformers fails on this config too); set use_sliding_window and "
            "sliding_window, or mark the layer 'full_attention'"
        )
    return [t == "sliding_attention" for t in layer_types]
