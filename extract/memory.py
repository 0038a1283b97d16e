"""Device memory of one extraction step: what must fit on each device, and the largest batch that does.

Arithmetic on the config, without devices or JAX, so `gcs-spawner plan` sizes a job on a laptop (the base install) and the engine checks a job
before it loads any weight. Per device, one step of `rows` rows of `seq_len` tokens holds (`StepMemory`):

- **weights** of the computed layers only: every parameter of the model the engine builds for `depth` layers
  (embedding, GPT-2's position table, the layers with whatever norms, biases and MLP their family has, the final
  norm when the whole stack is built), counted from the shapes it declares (`declared_shapes`, held equal to
  `nnx.eval_shape` of the built model by a test), in the compute dtype, each divided by the model axis where `extract.sharding.ShardingRules` splits its role (heads when
  they divide the axis, key/value heads only if the query heads split too, the MLP width, the hidden size of the
  embedding);
- **activations**: the peak inside one decoder layer, the larger of its attention half (residual, normed input,
  q/k/v, their float32 RoPE copies, the attention output and its projection) and its MLP half (residual, normed
  input, gate, up, their product, the projection; of a mixture of experts, every expert's, `moe_bytes_per_token`),
  per token;
- **attention**: the kernel's working set beyond those (`attention_bytes`): the materialised oracle's float32
  logits and probabilities ([rows, heads, T, T], the term that grows with T squared), cuDNN's softmax statistics
  (plus, for packed rows, the [rows, 1, T, T] same-document bias), splash's head-major copies of q/k/v/out;
- **outputs**: the kept layers' hidden states of this step in the compute dtype and in the output dtype, plus the
  outputs of `HELD_STEPS` earlier steps still on the device while the writer copies them to the host.

Every term but the weights is linear in `rows`, so the rows that fit follow in closed form (`rows_that_fit`).
The plan keeps `HEADROOM` of the usable memory for XLA's own scratch, fragmentation and this model's error; the
engine checks the compiled program's own figure (`CompiledMemoryStats`) against the whole usable memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re

from extract.config import ModelConfig
from extract.errors import BadInput

log = logging.getLogger(__name__)

#: Share of a device's usable memory a plan may fill; the rest is for XLA's scratch and this model's error.
HEADROOM = 0.8
#: Batches dispatched ahead of the writer (its queue; extract/consumer.py).
IN_FLIGHT_STEPS = 2
#: Earlier steps whose outputs can still be on the device while a step runs: the writer's queue and the batch its
#: collector is copying to the host (the dispatching thread, waiting for room in the queue, holds the current one).
HELD_STEPS = IN_FLIGHT_STEPS + 1

GIB = 2**30

#: HBM per chip, by the name JAX gives the device (`device.device_kind`) or the price table gives the accelerator
#: family (reporting/prices.json: v5e, "NVIDIA H100 80GB", ...); first match wins. Sources:
#: https://cloud.google.com/tpu/docs/v4 (32 GiB), https://cloud.google.com/tpu/docs/v5e (16 GiB),
#: https://cloud.google.com/tpu/docs/v5p (95 GiB), https://cloud.google.com/tpu/docs/v6e (32 GiB),
#: https://www.nvidia.com/en-us/data-center/h100/ (80 GB), https://www.nvidia.com/en-us/data-center/h200/ (141 GB),
#: https://www.nvidia.com/en-us/data-center/a100/ (40 or 80 GB), https://www.nvidia.com/en-us/data-center/l4/ (24 GB),
#: https://www.nvidia.com/en-us/data-center/dgx-b200/ (1,440 GB for 8 B200: 180 GB),
#: https://www.nvidia.com/en-us/data-center/tesla-t4/ (16 GB).
HBM_BYTES = (
    (r"TPU v6|^v6e$", 32 * GIB),
    (r"TPU v5 lite|TPU v5e|^v5e$", 16 * GIB),
    (r"TPU v5p|TPU v5$|^v5p$", 95 * GIB),
    (r"TPU v4|^v4$", 32 * GIB),
    (r"H200", 141 * 10**9),
    (r"H100", 80 * 10**9),
    (r"A100.*80GB", 80 * 10**9),
    (r"A100", 40 * 10**9),
    (r"\bL4\b", 24 * 10**9),
    (r"B200", 180 * 10**9),
    (r"\bT4\b", 16 * 10**9),
)
#: What the JAX client may allocate of a chip's HBM: on GPUs it preallocates 75% by default
#: (XLA_PYTHON_CLIENT_MEM_FRACTION; https://docs.jax.dev/en/latest/gpu_memory_allocation.html); a TPU's runtime
#: hands out nearly all of it.
CLIENT_FRACTION = {"gpu": 0.75, "tpu": 1.0}


class DeviceMemoryError(BadInput):
    """A step does not fit the device's memory: the job's `batch_size` or `max_seq_len` must shrink (exit 65)."""


def size(nbytes: float) -> str:
    """Bytes for people: GiB, MiB or KiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def hbm_bytes(name: str) -> int | None:
    """A chip's HBM from its `device_kind` or price-table family; None for unlisted ones."""
    for pattern, size in HBM_BYTES:
        if re.search(pattern, name):
            return size
    return None


def usable_bytes(name: str, platform: str) -> int | None:
    """What the JAX client can allocate on one such chip when the runtime does not say (`memory_stats`)."""
    size = hbm_bytes(name)
    return None if size is None else int(size * CLIENT_FRACTION.get(platform, 1.0))


def _split(size: int, axis: int) -> int:
    """The factor a dimension is divided by over the model axis: the axis when it divides, else 1 (replicated).
    The same rule as extract.sharding.ShardingRules.for_config (tests/extract_model/test_memory.py holds them equal)."""
    return axis if axis > 1 and size % axis == 0 else 1


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes on one device for one step; see the module docstring for each term."""

    weights: int
    activations: int
    attention: int
    outputs: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.attention + self.outputs

    def describe(self) -> str:
        return (
            f"{size(self.total)} (weights {size(self.weights)}, activations {size(self.activations)}, "
            f"attention {size(self.attention)}, kept outputs {size(self.outputs)})"
        )


def _role_splits(config: ModelConfig, model_axis: int) -> dict[str, int]:
    """What the model axis divides each tensor role by: the dimension it splits, where that divides the axis
    (`_split`), as extract.sharding.ShardingRules.for_config splits it (tests/extract_model/test_memory.py holds
    them equal); key/value heads only where the query heads split too."""
    heads = _split(config.num_attention_heads, model_axis)
    kv_heads = _split(config.num_key_value_heads, model_axis) if heads > 1 else 1
    ffw = _split(config.intermediate_size, model_axis)
    moe = config.moe
    by_expert = _split(moe.num_experts, model_axis) if moe else 1
    by_width = _split(moe.expert_size, model_axis) if moe and by_expert == 1 else 1
    return {
        "embedding": _split(config.hidden_size, model_axis), "q_proj": heads, "kv_proj": kv_heads, "o_proj": heads,
        "q_bias": heads, "kv_bias": kv_heads, "mlp_in": ffw, "mlp_out": ffw, "mlp_bias": ffw, "replicated": 1,
        "router": 1, "expert_in": by_expert * by_width, "expert_out": by_expert * by_width,
    }  # fmt: skip


def weight_bytes(config: ModelConfig, depth: int, compute_bytes: int, model_axis: int = 1) -> int:
    """Weights of the model computing `depth` layers on one device, in the compute dtype: the built model's
    parameters (`declared_shapes`), each divided by the model axis where the sharding rules split its role."""
    splits = _role_splits(config, model_axis)
    return sum(math.prod(shape) // splits[role] for shape, role in declared_shapes(config, depth)) * compute_bytes


def declared_shapes(config: ModelConfig, depth: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, sharding role) of every parameter `extract.model.DecoderModel` declares for `depth` layers, read
    from the config alone, without JAX: the planner runs on the base install (`pip install .`), which has none.
    tests/extract_model/test_memory.py holds it equal to the built model's own (`parameter_shapes`,
    `nnx.eval_shape`) for every family, and test_family_structure.py to transformers' parameter count."""
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def norm(shape: tuple[int, ...], role: str = "replicated") -> list:
        return [(shape, role)] * (2 if config.norm == "layer_norm" else 1)  # a LayerNorm has a bias

    layer = [((d, n, h), "q_proj"), ((d, k, h), "kv_proj"), ((d, k, h), "kv_proj"), ((n, h, d), "o_proj")]
    if config.qkv_bias:
        layer += [((n, h), "q_bias"), ((k, h), "kv_bias"), ((k, h), "kv_bias")]
    if config.o_bias:
        layer += [((d,), "replicated")]
    if config.qk_norm == "head":
        layer += norm((h,)) + norm((h,))
    elif config.qk_norm == "projection":
        layer += norm((n, h), "q_bias") + norm((k, h), "kv_bias")
    for _ in config.layer_norms:
        layer += norm((d,))

    def mlp(width: int) -> list:
        shapes = [((d, width), "mlp_in")] * (2 if config.mlp == "gated" else 1) + [((width, d), "mlp_out")]
        return shapes + ([((width,), "mlp_bias"), ((d,), "replicated")] if config.mlp_bias else [])

    def mixture(moe) -> list:  # extract.model.MoeBlock: the router, the stacked experts, a shared expert and its gate
        e, w = moe.num_experts, moe.expert_size
        shapes = [((d, e), "router"), ((e, d, w), "expert_in"), ((e, d, w), "expert_in"), ((e, w, d), "expert_out")]
        if moe.shared_expert_size:
            shapes += mlp(moe.shared_expert_size) + [((d, 1), "replicated")]
        return shapes

    shapes = [((config.vocab_size, d), "embedding")]
    if config.position_table:
        shapes.append(((config.position_table, d), "embedding"))
    for index in range(depth):
        moe = config.moe_layer(index)
        shapes += layer + (mixture(moe) if moe is not None else mlp(f))
    if depth == config.num_hidden_layers:
        shapes += norm((d,))
    return tuple(shapes)


@functools.lru_cache(maxsize=32)
def parameter_shapes(config: ModelConfig, depth: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, sharding role) of every parameter of the model the engine builds to compute `depth` layers, from
    `nnx.eval_shape` (shapes only; a 28-layer 7B model takes about half a second, so results are kept): the
    reference `declared_shapes` is held to."""
    import jax.numpy as jnp  # only here: the rest of this module is plain arithmetic
    from flax import nnx

    from extract.model import DecoderModel

    abstract = nnx.eval_shape(lambda: DecoderModel(config, depth, jnp.float32, nnx.Rngs(0)))
    return tuple(
        (tuple(variable.get_value().shape), variable.get_metadata()["role"])
        for _, variable in nnx.to_flat_state(nnx.state(abstract))
    )


def attention_bytes(
    kernel: str, tokens: int, rows: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, compute_bytes: int,
    packed: bool,
) -> int:
    """The attention kernel's working set on one device beyond q/k/v and its output (see the module docstring)."""
    squares = rows * seq_len * seq_len  # one [T, T] per row
    mask = squares if packed else 0  # a boolean same-document mask, [rows, T, T]
    if kernel in ("materialised", "xla"):
        # float32 logits and probabilities, and the probabilities cast to the compute dtype for the weighted sum:
        # a cast to float32 is no cast (`extract/attention.py`), so a float32 step holds two [T, T] per head, not
        # three (XLA:CPU's float32 program without YNNPACK, which a float32 job compiles: 8.3 bytes per element).
        cast = compute_bytes if compute_bytes < 4 else 0
        return int(heads * squares * (4 + 4 + cast) + mask)
    if kernel == "cudnn":
        return int(2 * 4 * rows * heads * seq_len + (squares * compute_bytes + mask if packed else 0))
    if kernel == "splash":
        return int(tokens * 2 * (heads + kv_heads) * head_dim * compute_bytes)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def step_memory(
    config: ModelConfig,
    *,
    depth: int,
    kept: float,
    rows: int,
    seq_len: int,
    compute_bytes: int,
    out_bytes: int,
    kernel: str = "materialised",
    packed: bool = False,
    model_axis: int = 1,
    held_steps: int = HELD_STEPS,
) -> StepMemory:
    """Bytes one device holds for a step of `rows` rows (its share of the batch) of `seq_len` tokens, computing
    `depth` decoder layers and returning `kept` hidden states' worth of outputs (`ModelConfig.hidden_units`)."""
    d, f, h = config.hidden_size, config.intermediate_size, config.head_dim
    q_split = _split(config.num_attention_heads, model_axis)
    heads = config.num_attention_heads // q_split
    kv_heads = config.num_key_value_heads // (_split(config.num_key_value_heads, model_axis) if q_split > 1 else 1)
    width = f // _split(f, model_axis)
    tokens = rows * seq_len
    c = compute_bytes
    attention_half = (4 * d + (2 * heads + 2 * kv_heads) * h) * c + (heads + kv_heads) * h * 4  # + float32 RoPE
    mlp_half = (3 * d + config.mlp_projections * width) * c  # gated: gate, up, their product; plain: up, act(up)
    if config.moe is not None and any(config.moe.sparse_layers[:depth]):
        mlp_half = max(mlp_half, moe_bytes_per_token(config, c, model_axis))
    inputs = 3 * 4 * (1 + held_steps)  # token ids, segment ids, positions: int32
    activations = tokens * (max(attention_half, mlp_half) + inputs) if depth else tokens * (d * c + inputs)
    attention = (
        attention_bytes(kernel, tokens, rows, seq_len, heads, kv_heads, h, c, packed) if depth else 0
    )
    outputs = kept * tokens * d * (c + out_bytes + held_steps * out_bytes)
    return StepMemory(weight_bytes(config, depth, c, model_axis), int(activations), attention, int(outputs))


def moe_bytes_per_token(config: ModelConfig, compute_bytes: int, model_axis: int = 1) -> int:
    """A mixture-of-experts layer's MLP half per token on one device (extract.model.MoeBlock): residual, normed input
    and output; the router's logits, float32 probabilities and each expert's weight; and every expert's gate, up,
    their product and its weighted copy ([E, F] per token: every expert runs on every token), split over the model
    axis by expert where the experts divide it, else by each expert's width (`extract.sharding`)."""
    moe = config.moe
    by_expert = _split(moe.num_experts, model_axis)
    by_width = _split(moe.expert_size, model_axis) if by_expert == 1 else 1
    experts = moe.num_experts // by_expert * (moe.expert_size // by_width)
    router = moe.num_experts * (compute_bytes + 4 + 4)
    shared = 3 * moe.shared_expert_size * compute_bytes
    return 3 * config.hidden_size * compute_bytes + router + 4 * experts * compute_bytes + shared


def check_fits(
    memory: int | None,
    device: str,
    *,
    batch_size: int,
    data_axis: int,
    max_seq_len: int,
    headroom: float = HEADROOM,
    need: int | None = None,
    **step,
) -> StepMemory:
    """Raise a `DeviceMemoryError` naming `batch_size` and `max_seq_len` when a step does not fit; else return the
    estimate.

    `step` holds `step_memory`'s arguments but `rows` and `seq_len`: the batch's share per device at max_seq_len
    is checked against `headroom * memory`. `need` is a measured figure (the compiled program's) to check instead,
    against the whole memory; the advice then scales the estimate's per-row bytes up to it. Nothing is checked
    when `memory` is None (unknown: CPU).
    """
    rows = batch_size // data_axis
    estimate = step_memory(rows=rows, seq_len=max_seq_len, **step)
    limit = memory if need is not None else None if memory is None else headroom * memory
    if limit is None or (need if need is not None else estimate.total) <= limit:
        return estimate
    fixed = estimate.weights
    if fixed > limit:
        raise DeviceMemoryError(
            f"the weights of {step['depth']} layers need {size(fixed)} per device, more than the "
            f"{size(limit)} planned of {device}'s {size(memory)}: split them over a model axis "
            "(mesh='data=1,model=N') or request shallower layers"
        )
    # Bytes beyond the weights grow with rows (linearly) and with seq_len; a measured need scales them up.
    scale = max(1.0, (need - fixed) / max(1, estimate.total - fixed)) if need is not None else 1.0

    def fits(rows: int, seq_len: int) -> bool:
        return fixed + scale * (step_memory(rows=rows, seq_len=seq_len, **step).total - fixed) <= limit

    fit_rows = rows
    while fit_rows > 0 and not fits(fit_rows, max_seq_len):
        fit_rows -= 1
    low, high = 0, max_seq_len  # the longest max_seq_len at this batch: bisect, the step grows with it
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(rows, middle) else (low, middle - 1)
    hints = []
    if fit_rows:
        hints.append(f"batch_size {fit_rows * data_axis} or less (a multiple of the data axis, {data_axis})")
    if low:
        hints.append(f"max_seq_len {low} or less at batch_size {batch_size}")
    figure = f"{size(need)} (the compiled program's own figure)" if need is not None else estimate.describe()
    raise DeviceMemoryError(
        f"batch_size={batch_size} at max_seq_len={max_seq_len} does not fit {device}: one step needs {figure} per "
        f"device, and {size(limit)} of its {size(memory)} are planned for. Use "
        + (" or ".join(hints) if hints else "a smaller batch_size and max_seq_len")
    )


def rows_that_fit(memory: int, headroom: float = HEADROOM, **step) -> int:
    """The most rows per device whose step fits `headroom * memory` (0 when even one row does not).

    `step` holds `step_memory`'s arguments but `rows`. Every term but the weights grows linearly with rows.
    """
    fixed = step_memory(rows=0, **step).total
    per_row = step_memory(rows=1, **step).total - fixed
    budget = headroom * memory - fixed
    return max(0, int(budget // per_row)) if per_row > 0 else 0


# -- the mesh that fits -------------------------------------------------------------------------------------------


def replica_bytes(
    config: ModelConfig,
    num_layers: int,
    batch_per_replica: int,
    seq_len: int,
    compute_bytes: int,
    out_bytes: int,
    num_outputs: float,
    model_axis_size: int = 1,
) -> int:
    """Estimated device memory for one replica: weights of the computed layers plus one micro-batch's step
    (`extract.memory.step_memory`, with the materialised attention: the largest working set of the kernels)."""
    return step_memory(
        config, depth=num_layers, kept=num_outputs, rows=batch_per_replica, seq_len=seq_len,
        compute_bytes=compute_bytes, out_bytes=out_bytes, model_axis=model_axis_size,
    ).total  # fmt: skip


def choose_mesh_shape(
    config: ModelConfig,
    device_count: int,
    device_memory: int | None,
    *,
    num_layers: int,
    batch_size: int,
    seq_len: int,
    compute_bytes: int,
    out_bytes: int,
    num_outputs: float,
) -> tuple[int, int]:
    """(data, model) for the automatic policy described in the module docstring.

    `device_memory` is one device's usable bytes (`extract.sharding.device_memory_bytes`), None when unknown
    (treated as ample).
    """
    count, memory = device_count, device_memory
    candidates = [m for m in range(1, count + 1) if count % m == 0]
    fitting = []
    for m in candidates:
        data = count // m
        need = replica_bytes(
            config, num_layers, max(1, batch_size // data), seq_len, compute_bytes, out_bytes, num_outputs, m
        )
        if memory is None or need <= HEADROOM * memory:
            fitting.append(m)
    if not fitting:
        log.warning(
            "event=mesh_memory_tight devices=%d device_memory=%s: no layout fits the estimate; using model=%d",
            count, memory, count,
        )  # fmt: skip
        return 1, count
    # The batch must split evenly over "data"; when it does not, move devices from "data" to "model" until it does
    # (data=1 always works), which costs speed but never correctness.
    usable = [m for m in candidates if m >= fitting[0] and batch_size % (count // m) == 0]
    m = usable[0]
    if m != fitting[0]:
        log.info(
            "event=mesh_for_batch batch_size=%d devices=%d data=%d model=%d: batch_size does not split over data=%d",
            batch_size, count, count // m, m, count // fitting[0],
        )  # fmt: skip
    return count // m, m
