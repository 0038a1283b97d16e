"""Which attention kernel computes a model's attention: the one decision, a pure function without JAX.

The engine asks it once for its devices (`extract.engine`, logged as `event=attention`) and binds the kernel around
its traces (`extract.attention`); the planner asks it for the accelerator it prices (`reporting.plan`), so the
memory a plan counts for attention is that of the kernel the engine will run. Both ask through `for_model`, which
reads what the decision needs from the model's `ModelConfig` (its head size and Gemma 2's logit soft-cap), so no
caller can hand it a field of its own reading.

| kernel | what | where `choose_kernel` picks it |
|---|---|---|
| `materialised` | the readable oracle (extract/attention.py) | CPU; float32 compute anywhere; whatever a fused kernel cannot do |
| `cudnn` | cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")` | GPU, bf16/fp16 |
| `splash` | Pallas splash attention | TPU |
| `xla` | `jax.nn.dot_product_attention(implementation="xla")` | only when asked (tests) |
"""

from __future__ import annotations

import dataclasses

from extract.errors import BadInput

MATERIALISED, XLA, CUDNN, SPLASH = "materialised", "xla", "cudnn", "splash"
KERNELS = (MATERIALISED, XLA, CUDNN, SPLASH)
#: cuDNN flash attention's head-dim limit: 256 on Hopper and later, 128 before (jax._src.cudnn.fused_attention_
#: stablehlo.check_is_flash_attention), and a multiple of 8.
CUDNN_MAX_HEAD_DIM = {True: 256, False: 128}
_HALF = ("bfloat16", "float16")


class AttentionUnavailable(BadInput):
    """An attention kernel was asked for where it cannot run (wrong backend, dtype, head size, or soft-capping)."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which kernel computes attention, and why: the line the engine logs once at start."""

    kernel: str
    reason: str


def dtype_name(dtype) -> str:
    """'bfloat16', 'float16', 'float32', ... of a dtype name, a numpy/JAX dtype or a JAX scalar type."""
    if isinstance(dtype, str):
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    return str(getattr(dtype, "name", None) or getattr(dtype, "__name__", dtype))


def for_model(platform: str, dtype, config, *, requested: str = "auto", hopper: bool = True) -> Choice:
    """The decision for a model (`extract.config.ModelConfig`): its head size and its logit soft-cap
    (`attention_softcap`, Gemma 2's; None for the other families)."""
    return choose_kernel(platform, dtype, config.head_dim, softcap=config.attention_softcap, requested=requested,
                         hopper=hopper)  # fmt: skip


def choose_kernel(
    platform: str,
    dtype,
    head_dim: int,
    *,
    softcap: float | None = None,
    requested: str = "auto",
    hopper: bool = True,
) -> Choice:
    """The decision, as a table: the fused kernel of the backend when it can do the job, else the oracle.

    `platform` is the devices' (`cpu`, `gpu`, `tpu`), `dtype` the compute dtype (a name or a dtype), `softcap`
    the model's logit soft-cap (None if it has none), `hopper` whether the GPU is compute capability 9.0 or later.
    `requested` is `auto` or a kernel name; a named kernel that cannot serve this model is an
    `AttentionUnavailable` naming `attention`.
    """
    name = dtype_name(dtype)
    half = name in _HALF
    limit = CUDNN_MAX_HEAD_DIM[hopper]
    cudnn_refusal = (
        f"platform {platform} is not a GPU" if platform != "gpu"
        else f"compute dtype {name}: cuDNN flash attention takes bf16 or fp16" if not half
        else f"head_dim {head_dim}: cuDNN flash attention needs a multiple of 8, at most {limit}"
        if head_dim % 8 or head_dim > limit
        else "softcap: jax.nn.dot_product_attention has no logit soft-capping" if softcap is not None
        else None
    )  # fmt: skip
    if requested == "auto":
        if not half:
            # cuDNN takes no float32; splash's in-kernel matmuls would not honour HIGHEST. The oracle does.
            return Choice(MATERIALISED, f"compute dtype {name}: the oracle, at HIGHEST matmul precision")
        if platform == "gpu":
            if cudnn_refusal is None:
                return Choice(CUDNN, "GPU: cuDNN flash attention through jax.nn.dot_product_attention")
            return Choice(MATERIALISED, f"no fused GPU kernel for this model ({cudnn_refusal})")
        if platform == "tpu":
            return Choice(SPLASH, "TPU: Pallas splash attention")
        return Choice(MATERIALISED, f"platform {platform}: no fused kernel")
    if requested in (MATERIALISED, XLA):
        return Choice(requested, "requested")
    if requested == CUDNN:
        if cudnn_refusal is not None:
            raise AttentionUnavailable(f"attention={requested!r} cannot run here: {cudnn_refusal}; use 'auto'")
        return Choice(CUDNN, "requested")
    if requested == SPLASH:
        where = "requested" if platform == "tpu" else f"requested; Pallas interpret mode on {platform} (slow)"
        return Choice(SPLASH, where)
    raise AttentionUnavailable(f"attention={requested!r} is not a kernel: use 'auto' or one of {', '.join(KERNELS)}")
