"""The Qwen architecture description: read once from a checkpoint's `config.json`, then frozen.

Both the transformers v4 spelling (`rope_theta`, `rope_scaling`, `use_sliding_window` + `max_window_layers`) and the
v5 spelling (`rope_parameters`, `layer_types`) are understood, because hub checkpoints carry the former and
checkpoints saved by a current transformers carry the latter.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from extract.errors import BadInput

#: model_type -> architecture family. Qwen2.5 checkpoints say "qwen2".
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")


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
    rope_theta: float
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

        rope_theta = _rope_theta(raw, source)
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
            rope_theta=rope_theta,
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
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias if self.model_type == "qwen3" else False,
            "hidden_act": "silu",
            "use_sliding_window": bool(windows),
            "sliding_window": windows[0] if windows else None,
            "layer_types": ["full_attention" if w is None else "sliding_attention" for w in self.sliding_windows],
        }


def _rope_theta(raw: Mapping[str, Any], source: str) -> float:
    # v5 folds theta and the scaling type into rope_parameters; v4 has rope_theta plus an optional rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
        raise BadInput(f"{source}: rope_parameters / rope_scaling must be JSON objects or null")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise BadInput(
            f"{source}: rope_type={rope_type!r} (rope_scaling / rope_parameters) is not supported; only the default "
            "RoPE is implemented. Use the checkpoint without long-context rope scaling."
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise BadInput(f"{source}: rope_theta={theta!r} must be a positive number")
    return float(theta)


def _sliding_windows(raw: Mapping[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    if not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    window = raw.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise BadInput(f"{source}: use_sliding_window is true but sliding_window={window!r} is not a positive integer")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        # transformers' rule before layer_types existed: layers from max_window_layers on slide.
        first_sliding = raw.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise BadInput(
            f"{source}: layer_types must list 'full_attention' or 'sliding_attention' once per layer ({num_layers})"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
