"""Rotary position embeddings as transformers 5 reads them from a `config.json`: which fields win, and the inverse
frequencies and attention scaling of each supported `rope_type`.

The rules are transformers' own (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` and
`standardize_rope_params`, and the `_compute_*_parameters` functions of `modeling_rope_utils.py`, 5.23):

- A non-empty `rope_scaling` (v4 spelling) replaces `rope_parameters` (v5 spelling) whole.
- `rope_theta` inside the chosen block wins; else the top-level `rope_theta`; else 10000.
- `rope_type` wins over the legacy `type`; neither means `default`.
- For `yarn`, `llama3` and `longrope`, a top-level `original_max_position_embeddings` wins over the block's, which
  defaults to `max_position_embeddings` (when absent, the family's config default: 32768 for Qwen, 2048 for Llama, ...).
- Gemma 3 has one block per layer type (`read_layer_type_ropes`: full attention and sliding attention).
- A `partial_rotary_factor` f rotates the first `int(head_dim * f)` values of each head and passes the rest through,
  in the families whose rotary embedding reads it (GPT-NeoX, Phi-3: the caller says so, `partial_rotary=True`).

Honoured exactly: `default`, `linear`, `yarn`, `llama3` (their frequencies do not depend on the input), and
`longrope` up to its `original_max_position_embeddings` (`Rope.max_positions`): transformers uses the short factors
while the longest position of a call is within it and switches to the long ones past it, so the engine refuses a
`max_seq_len` beyond it. Refused with a `BadInput` naming the field: `dynamic` (transformers recomputes its
frequencies from each call's longest position, so a sample's values would depend on its batch), any other type, a
`partial_rotary_factor` other than 1 where the family's RoPE ignores it, per-layer-type RoPE blocks where the family
has one RoPE, and a config that carries both `rope_scaling` and a different `rope_parameters` (transformers silently
drops the latter, its `rope_theta` included: a Qwen2.5 config saved by transformers 5 with a YaRN `rope_scaling`
pasted in from a model card would run at theta 10000; say which one is meant instead).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from extract.errors import BadInput

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "longrope")
#: transformers' defaults: `RotaryEmbeddingConfigMixin.default_theta`, Qwen2Config/Qwen3Config.max_position_embeddings
#: (each family passes its own `max_position_embeddings` default).
DEFAULT_THETA = 10000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
#: Keys each type needs (transformers raises KeyError without them; theta and the original length always get a
#: default first).
_REQUIRED = {
    "linear": ("factor",), "yarn": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}  # fmt: skip
#: The types whose pretraining length (`original_max_position_embeddings`) matters.
_WITH_ORIGINAL_LENGTH = ("yarn", "llama3", "longrope")
_WHY_REFUSED = {
    "dynamic": "transformers recomputes its frequencies from the longest position of each call, so a sample's "
    "hidden states would depend on the batch it lands in",
    "proportional": "it is not a RoPE of the supported families and is not implemented here",
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """The resolved RoPE: `parameters` as transformers holds them after standardisation (sorted items, for the
    checkpoint mirror), and what the forward pass needs: float32 inverse frequencies [rotary_dim / 2] (the first
    `rotary_dim` values of each head rotate, all of them unless the RoPE is partial) and the factor that multiplies
    sin and cos (YaRN's and LongRoPE's attention factor; 1 otherwise). `max_positions`: the longest sequence whose
    frequencies these are (LongRoPE's pretraining length; None: any)."""

    rope_type: str
    theta: float
    parameters: tuple[tuple[str, Any], ...]
    inverse_frequencies: tuple[float, ...]
    attention_scaling: float
    max_positions: int | None = None

    @property
    def rotary_dim(self) -> int:
        """The values of each head that rotate (the first ones); the rest pass through."""
        return 2 * len(self.inverse_frequencies)

    def inverse_frequency_array(self) -> np.ndarray:
        return np.asarray(self.inverse_frequencies, dtype=np.float32)


def _number(value: Any, field: str, source: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise BadInput(f"{source}: {field}={value!r} must be a {'positive ' if positive else ''}number")
    return float(value)


def _block(raw: Mapping[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """The RoPE block transformers uses, and the name of the field it came from."""
    blocks = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = raw.get(name)
        if value is not None and not isinstance(value, Mapping):
            raise BadInput(f"{source}: {name} must be a JSON object or null, got {type(value).__name__}")
        blocks[name] = dict(value or {})
    scaling, parameters = blocks["rope_scaling"], blocks["rope_parameters"]
    if scaling and parameters and scaling != parameters:
        raise BadInput(
            f"{source}: rope_scaling={scaling} and rope_parameters={parameters} disagree. transformers uses "
            "rope_scaling alone and drops rope_parameters, its rope_theta included (theta falls back to the "
            "top-level rope_theta, else 10000). Keep the RoPE you mean in one of them (e.g. add its rope_type, "
            "factor and rope_theta to rope_parameters and delete rope_scaling)"
        )
    return ("rope_scaling", scaling) if scaling else ("rope_parameters", parameters)


def one_block(raw: Mapping[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """The one RoPE block of a family with one RoPE for every layer, and the field it came from (`rope_scaling`
    replaces `rope_parameters` whole, as transformers' `convert_rope_params_to_dict` does)."""
    field, block = _block(raw, source)
    if any(isinstance(value, Mapping) for value in block.values()):
        nested = [key for key, value in block.items() if isinstance(value, Mapping)]
        raise BadInput(
            f"{source}: {field} holds per-layer-type blocks ({', '.join(nested)}); this model type reads one RoPE "
            "for every layer (transformers fails on this config too)"
        )
    return field, block


def read_rope(
    raw: Mapping[str, Any],
    head_dim: int,
    source: str = "config.json",
    *,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    default_theta: float = DEFAULT_THETA,
) -> Rope:
    """Resolve a config dict's RoPE fields as transformers' generic `convert_rope_params_to_dict` does; `BadInput`
    for whatever is not honoured exactly.

    `max_position_embeddings` is the family's default for that field (transformers' config class default), and
    `default_theta` its base when config.json gives none (the config class's `default_theta`: 1e6 for Mixtral)."""
    field, block = one_block(raw, source)
    block.setdefault("rope_theta", raw["rope_theta"] if "rope_theta" in raw else default_theta)
    if "partial_rotary_factor" in raw:
        block.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    return resolve_block(
        block, field, head_dim, source, max_position_embeddings=raw.get("max_position_embeddings", max_position_embeddings),
        original=raw.get("original_max_position_embeddings"),
    )  # fmt: skip


def read_layer_type_ropes(
    raw: Mapping[str, Any],
    head_dim: int,
    source: str,
    *,
    max_position_embeddings: int,
    full_theta: float,
    sliding_theta: float,
) -> tuple[Rope, Rope]:
    """(full-attention, sliding-attention) RoPE of a model with one RoPE per layer type, as transformers 5 reads
    Gemma 3 (`Gemma3TextConfig.convert_rope_params_to_dict`, then `standardize_rope_params`):

    - `rope_parameters` holds a block per layer type; a missing or null block is `{"rope_type": "default"}`;
    - a v4 `rope_scaling` updates the full-attention block (key by key);
    - the full block's theta defaults to the top-level `rope_theta`, else `full_theta`; the sliding block's to
      `rope_local_base_freq`, else `sliding_theta`;
    - for `yarn`, `llama3` and `longrope`, `original_max_position_embeddings` defaults to `max_position_embeddings`
      (a top-level one does not win here, unlike the one-block case).
    """
    parameters = raw.get("rope_parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise BadInput(f"{source}: rope_parameters must be a JSON object or null, got {type(parameters).__name__}")
    parameters = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (parameters or {}).items()}
    flat = sorted(k for k, v in parameters.items() if not isinstance(v, Mapping) and v is not None)
    unknown = sorted(set(parameters) - {"full_attention", "sliding_attention"} - set(flat))
    if flat or unknown:
        raise BadInput(
            f"{source}: rope_parameters holds {', '.join(flat + unknown)}; this model type reads one block per layer "
            "type, {\"full_attention\": {...}, \"sliding_attention\": {...}} (transformers ignores other keys "
            "silently); move the settings into those blocks"
        )
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise BadInput(f"{source}: rope_scaling must be a JSON object or null, got {type(scaling).__name__}")
        if raw.get("rope_parameters") is not None and parameters.get("full_attention") is None:
            raise BadInput(
                f"{source}: rope_scaling is given but rope_parameters has no full_attention block to apply it to "
                "(transformers fails on this config too); put the scaling in rope_parameters.full_attention"
            )
        parameters.setdefault("full_attention", {"rope_type": "default"})
        parameters["full_attention"].update(scaling)
    full = parameters.get("full_attention") or {"rope_type": "default"}
    full.setdefault("rope_theta", raw["rope_theta"] if "rope_theta" in raw else full_theta)
    sliding = parameters.get("sliding_attention") or {"rope_type": "default"}
    sliding.setdefault("rope_theta", raw["rope_local_base_freq"] if "rope_local_base_freq" in raw else sliding_theta)
    for block in (full, sliding):
        if "partial_rotary_factor" in raw:
            block.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    max_positions = raw.get("max_position_embeddings", max_position_embeddings)
    return (
        resolve_block(full, "rope_parameters.full_attention", head_dim, source, max_position_embeddings=max_positions),
        resolve_block(
            sliding, "rope_parameters.sliding_attention", head_dim, source, max_position_embeddings=max_positions
        ),
    )


def resolve_block(
    block: dict[str, Any],
    field: str,
    head_dim: int,
    source: str,
    *,
    max_position_embeddings: int,
    original: int | None = None,
    partial_rotary: bool = False,
) -> Rope:
    """One RoPE block (its `rope_theta` already chosen) resolved to frequencies and scaling, as transformers'
    `standardize_rope_params` and `_compute_*_parameters` do; `field` names the block in errors.

    `max_position_embeddings` is the config's (as read, or the family's default); `original`, where given, is the
    `original_max_position_embeddings` that wins over the block's. `partial_rotary`: the family's RoPE rotates the
    first `int(head_dim * partial_rotary_factor)` values of a head (NeoX, Phi-3); elsewhere a factor other than 1 is
    refused, because transformers' default RoPE of those families ignores it and its scaled ones do not."""
    block.setdefault("rope_type", block.get("type", "default"))
    rope_type = block["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        known = isinstance(rope_type, str) and rope_type in _WHY_REFUSED
        why = _WHY_REFUSED[rope_type] if known else "transformers does not know it either"
        raise BadInput(
            f"{source}: {field}.rope_type={rope_type!r} is not supported ({why}); supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = block.get("partial_rotary_factor", 1.0)
    if not partial_rotary and partial != 1:
        raise BadInput(
            f"{source}: partial_rotary_factor={partial!r} is not supported for this model type, whose RoPE rotates "
            "the whole head (transformers ignores it for the default RoPE and uses it for the scaled ones)"
        )
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise BadInput(f"{source}: partial_rotary_factor={partial!r} must be a number in (0, 1]")
    dim = int(head_dim * partial)  # transformers' int(): 96 * 0.75 = 72
    if dim < 2 or dim % 2:
        raise BadInput(
            f"{source}: partial_rotary_factor={partial!r} rotates {dim} of head_dim={head_dim} values; that must be "
            "a positive even number"
        )
    theta = _number(block["rope_theta"], "rope_theta", source)
    for key in _REQUIRED.get(rope_type, ()):
        if key not in block:
            raise BadInput(f"{source}: {field}.{key} is missing; rope_type {rope_type!r} needs it")
    max_positions = max_position_embeddings
    if rope_type in _WITH_ORIGINAL_LENGTH:
        if original is not None:
            block["original_max_position_embeddings"] = original
        else:
            block.setdefault("original_max_position_embeddings", max_positions)

    def number(key: str, *, positive: bool = True) -> float:
        return _number(block[key], f"{field}.{key}", source, positive=positive)

    # The angles' exponents, in float32 as transformers computes them: arange(0, dim, 2).float() / dim.
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    scaling, limit = 1.0, None
    if rope_type == "default":
        inverse = 1.0 / (theta**exponents)
    elif rope_type == "linear":
        inverse = (1.0 / (theta**exponents)) / number("factor")
    elif rope_type == "yarn":
        inverse, scaling = _yarn(block, theta, exponents, dim, max_positions, number)
    elif rope_type == "longrope":
        inverse, scaling, limit = _longrope(block, field, source, theta, exponents, max_positions, number)
    else:
        if block["high_freq_factor"] == block["low_freq_factor"]:
            raise BadInput(f"{source}: {field}.high_freq_factor must differ from low_freq_factor")
        inverse = _llama3(theta, exponents, number)
    inverse = np.asarray(inverse, dtype=np.float32)
    return Rope(
        rope_type=rope_type,
        theta=theta,
        # Hashable, as a static part of the Flax model: JSON lists become tuples.
        parameters=tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in block.items())),
        inverse_frequencies=tuple(float(x) for x in inverse),
        attention_scaling=float(scaling),
        max_positions=limit,
    )


def _longrope(block, field, source, theta, exponents, max_positions, number) -> tuple[np.ndarray, float, int]:
    """transformers' `_compute_longrope_parameters` at the lengths where it uses `short_factor` (up to
    `original_max_position_embeddings`, the returned limit): the frequencies divided by the short factors, and the
    attention factor on sin and cos (`attention_factor`, or from `factor`, else max_position_embeddings / original),
    which applies at every length."""
    original = number("original_max_position_embeddings")
    if isinstance(block["original_max_position_embeddings"], float) and not original.is_integer():
        raise BadInput(f"{source}: {field}.original_max_position_embeddings={original!r} must be an integer")
    for key in ("short_factor", "long_factor"):
        factors = block[key]
        if not isinstance(factors, (list, tuple)) or len(factors) != len(exponents) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in factors
        ):
            raise BadInput(
                f"{source}: {field}.{key} must list {len(exponents)} positive numbers (one per rotated pair of a head)"
            )
    factor = number("factor") if block.get("factor") is not None else max_positions / original
    if block.get("attention_factor") is not None:
        attention_factor = number("attention_factor", positive=False)
    else:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = np.asarray(block["short_factor"], dtype=np.float32)
    return 1.0 / (short * theta**exponents), float(attention_factor), int(original)


def _yarn(block, theta, exponents, dim, max_positions, number) -> tuple[np.ndarray, float]:
    """transformers' `_compute_yarn_parameters`, step by step in the same precision."""
    original = number("original_max_position_embeddings")
    if block["factor"] is None:  # as DeepSeek-V3 configs: the ratio of the two context lengths
        factor = max_positions / original
    else:
        factor = number("factor")

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = block.get("attention_factor")
    mscale, mscale_all_dim = block.get("mscale"), block.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    else:
        attention_factor = number("attention_factor", positive=False)
    beta_fast = block.get("beta_fast") or 32
    beta_slow = block.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if block.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_weight = 1 - ramp
    position_frequencies = theta**exponents
    interpolated = 1.0 / (factor * position_frequencies)
    extrapolated = 1.0 / position_frequencies
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight, float(attention_factor)


def _llama3(theta, exponents, number) -> np.ndarray:
    """transformers' `_compute_llama3_parameters`: long wavelengths divided by `factor`, a smooth blend between."""
    inverse = 1.0 / (theta**exponents)
    factor, low_factor, high_factor = number("factor"), number("low_freq_factor"), number("high_freq_factor")
    old_context = number("original_max_position_embeddings")
    low_wavelength, high_wavelength = old_context / low_factor, old_context / high_factor
    wavelength = 2 * math.pi / inverse
    scaled = np.where(wavelength > low_wavelength, inverse / factor, inverse)
    smooth = (old_context / wavelength - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
    return np.where(medium, smoothed, scaled)
