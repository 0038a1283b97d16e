"""How the model is laid out on devices: the ("data", "model") mesh and one PartitionSpec per tensor role.

Policy. Every local device joins one mesh. Batches are split over "data". Over "model" we split attention heads
and the MLP intermediate dimension (tensor parallelism), and a mixture's experts (by expert where their count
divides the axis, else by each expert's width), each only where its size divides the axis; key/value heads
that are fewer than the axis, or do not divide it, stay replicated. The automatic choice
(`extract.memory.choose_mesh_shape`, beside the memory model it rests on) is pure data parallelism whenever one
replica (weights plus one micro-batch's activations) fits a device, because that needs no collectives at all;
otherwise the smallest model axis that makes it fit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from extract.config import ModelConfig
from extract.errors import BadInput

log = logging.getLogger(__name__)

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """One PartitionSpec per tensor role; shapes in the comments use the model's einsum letters."""

    embedding: P  # [V, D], and GPT-2's position table [P, D]
    q_proj: P  # [D, N, H]
    kv_proj: P  # [D, K, H]
    o_proj: P  # [N, H, D]
    q_bias: P  # [N, H], and OLMo 2's q norm
    kv_bias: P  # [K, H], and OLMo 2's k norm
    mlp_in: P  # [D, F] gate and up projections
    mlp_out: P  # [F, D] down projection
    mlp_bias: P  # [F] the up projection's bias (GPT-2, NeoX)
    router: P  # [D, E] a mixture's router
    expert_in: P  # [E, D, F] its experts' gate and up projections
    expert_out: P  # [E, F, D] their down projections
    replicated: P  # norm scales, output bias
    tokens: P  # [B, T]
    activations: P  # [B, T, D], also every returned output ([B, T, F] for the MLP's hidden activations)

    @classmethod
    def for_config(cls, config: ModelConfig, model_axis_size: int) -> ShardingRules:
        def split_if_divides(size: int) -> str | None:
            return MODEL if model_axis_size > 1 and size % model_axis_size == 0 else None

        heads = split_if_divides(config.num_attention_heads)
        # Query heads are grouped by key/value head, so both splits line up only when both divide the axis.
        kv_heads = split_if_divides(config.num_key_value_heads) if heads else None
        ffw = split_if_divides(config.intermediate_size)
        hidden = split_if_divides(config.hidden_size)
        # A mixture's experts split by expert where their count divides the axis (each device computes its experts'
        # share of every token, one all-reduce adds them), else by each expert's width, as a dense MLP's.
        moe = config.moe
        by_expert = split_if_divides(moe.num_experts) if moe else None
        expert_width = None if by_expert or not moe else split_if_divides(moe.expert_size)
        return cls(
            embedding=P(None, hidden),
            q_proj=P(None, heads, None),
            kv_proj=P(None, kv_heads, None),
            o_proj=P(heads, None, None),
            q_bias=P(heads, None),
            kv_bias=P(kv_heads, None),
            mlp_in=P(None, ffw),
            mlp_out=P(ffw, None),
            mlp_bias=P(ffw),
            router=P(),
            expert_in=P(by_expert, None, expert_width),
            expert_out=P(by_expert, expert_width, None),
            replicated=P(),
            tokens=P(DATA, None),
            activations=P(DATA, None, None),
        )


def parse_mesh(spec: str, device_count: int) -> tuple[int, int]:
    """`"data=2,model=2"` -> (2, 2). An axis left out has size 1; the product must equal `device_count`."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in AXES or name in sizes:
            raise BadInput(
                f"mesh={spec!r} is not valid: write it as 'data=D,model=M' with each of {', '.join(AXES)} at most once"
            )
        try:
            size = int(value)
        except ValueError:
            raise BadInput(f"mesh={spec!r}: axis {name} has size {value.strip()!r}, which is not an integer") from None
        if size < 1:
            raise BadInput(f"mesh={spec!r}: axis {name} must have size >= 1")
        sizes[name] = size
    shape = (sizes.get(DATA, 1), sizes.get(MODEL, 1))
    if shape[0] * shape[1] != device_count:
        raise BadInput(
            f"mesh={spec!r} spans {shape[0] * shape[1]} devices but {device_count} are present: "
            f"make data * model = {device_count}, or leave mesh unset for the automatic choice"
        )
    return shape


def default_devices() -> list[jax.Device]:
    """This host's devices; on a multi-host slice (extract.multihost) every host's, listed process by process."""
    if jax.process_count() == 1:
        return jax.local_devices()
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def make_mesh(shape: tuple[int, int], devices: Sequence[jax.Device]) -> Mesh:
    # Auto axes: XLA propagates shardings from the weights and the batch; the model pins only the activations.
    axis_types = (AxisType.Auto, AxisType.Auto)
    if len({d.process_index for d in devices}) > 1:
        # Across hosts, devices stay in process order (data outermost): host h's rows of a global batch,
        # [h * B / hosts, (h + 1) * B / hosts), then always live on host h's devices, whatever the shape.
        return Mesh(np.array(list(devices), dtype=object).reshape(shape), AXES, axis_types=axis_types)
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=list(devices))


def device_memory_bytes(device: jax.Device) -> int | None:
    """Usable memory of one device, or None where the runtime does not say (CPU: treated as ample)."""
    try:
        stats = device.memory_stats()
    except (RuntimeError, NotImplementedError):  # some backends raise instead of returning None
        return None
    if not stats:
        return None
    limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
    return int(limit) if limit else None


def mesh_summary(mesh: Mesh) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


__all__ = [
    "AXES",
    "DATA",
    "MODEL",
    "ShardingRules",
    "default_devices",
    "device_memory_bytes",
    "make_mesh",
    "mesh_summary",
    "parse_mesh",
]
