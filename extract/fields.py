"""How a family's reader sees one config.json: its fields with the family's transformers defaults, checked as
transformers checks them (`Fields`), and the readings several families share (the Llama-like decoder's sizes,
sliding windows). The families themselves, one registry entry each, are `extract/families.py`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extract.errors import BadInput
from extract.rope import DEFAULT_THETA, Rope, read_rope

#: transformers' ACT2FN names -> the activation the MLP applies (`extract.model.ACTIVATIONS`).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


class Fields:
    """One config.json's fields, with its family's transformers defaults, checked as transformers' strict
    dataclass validation checks them (an int field takes no float or bool, a bool field no string or 1).

    `defaults`, `aliases` and `nullable_kv_heads` are the family's (`extract.families.Family`)."""

    def __init__(
        self,
        raw: Mapping[str, Any],
        source: str,
        model_type: str,
        *,
        defaults: Mapping[str, Any],
        aliases: Mapping[str, str],
        nullable_kv_heads: bool,
    ):
        self.raw, self.source, self.model_type = raw, source, model_type
        self.defaults, self.aliases, self.nullable_kv_heads = defaults, aliases, nullable_kv_heads

    def key(self, name: str) -> str:
        """The config.json key that holds `name`: the name itself wins over the family's alias (GPT-2's n_embd)."""
        alias = self.aliases.get(name)
        return alias if alias is not None and name not in self.raw and alias in self.raw else name

    def get(self, name: str) -> Any:
        key = self.key(name)
        return self.raw[key] if key in self.raw else self.defaults.get(self.aliases.get(name, name))

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
        return self.positive("num_key_value_heads", null_means=heads if self.nullable_kv_heads else None)

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

    def rope(self, head_dim: int, default_theta: float = DEFAULT_THETA) -> Rope:
        return read_rope(
            self.raw, head_dim, self.source, max_position_embeddings=self.defaults["max_position_embeddings"],
            default_theta=default_theta,
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


def decoder(f: Fields, common: dict, head_dim: int, **rest) -> dict:
    """What the Llama-like families read alike: the MLP's width, the key/value heads and the RMSNorm's epsilon."""
    return dict(intermediate_size=f.positive("intermediate_size"), num_key_value_heads=f.kv_heads(
        common["num_attention_heads"]), head_dim=head_dim, norm_eps=f.number("rms_norm_eps"), **rest)  # fmt: skip



def window(f: Fields) -> int | None:
    """Mistral's and Phi-3's one window for every layer: `sliding_window`, null for none."""
    window = f.get("sliding_window")
    return None if window is None else f.positive("sliding_window")


def qwen_windows(f: Fields, num_layers: int) -> tuple[int | None, ...]:
    # transformers' Qwen2Config/Qwen3Config.__post_init__: the window exists only under use_sliding_window (a bool);
    # there an absent sliding_window is 4096 and an explicit null means no window. Without layer_types, layers from
    # max_window_layers on slide (28 when absent), and only when there is a window.
    window = f.get("sliding_window") if f.flag("use_sliding_window") else None
    if f.get("layer_types") is not None:
        off = "sliding_window is null" if f.get("use_sliding_window") else "use_sliding_window is not true"
        return windows_from_layer_types(f, [], window, off)
    first_sliding = f.get("max_window_layers")
    if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
        raise f.bad("max_window_layers", "must be a non-negative integer")
    return checked_windows(f, [window is not None and i >= first_sliding for i in range(num_layers)], window)


def windows_from_layer_types(f: Fields, default: list[str], window: Any, why_no_window: str) -> tuple[int | None, ...]:
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
    return checked_windows(f, [t == "sliding_attention" for t in layer_types], window)


def checked_windows(f: Fields, sliding: list[bool], window: Any) -> tuple[int | None, ...]:
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise BadInput(
            f"{f.source}: sliding layers need a window, but sliding_window={window!r} is not a positive integer "
            "(null means no window)"
        )
    return tuple(window if slides else None for slides in sliding)

