"""Attention: one function the decoder layers call, and the one decision of which kernel computes it.

`attend` is the only entry point the layers use. Four kernels sit behind it:

| kernel | what | where `choose_kernel` picks it |
|---|---|---|
| `materialised` | the readable oracle below: a [B, K, G, T, S] float32 logits tensor, masked, softmax, weighted sum | CPU; float32 compute anywhere; whatever a fused kernel cannot do |
| `cudnn` | cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")` | GPU, bf16/fp16 |
| `splash` | Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) | TPU |
| `xla` | `jax.nn.dot_product_attention(implementation="xla")`: the cuDNN path's arguments on XLA's own kernel | only when asked (tests: it checks how we drive the cuDNN path, on CPU) |

The decision is `extract.kernel_choice` (JAX-free: the planner asks it too). The engine makes it once, logs it
once (`event=attention`), and binds it around the trace of its programs
(`with use(Binding(...))`). Outside a binding (tests of the model, tools), `attend` is the oracle.

Shapes: q [B, T, N, H], k and v [B, S, K, H], the result [B, T, N, H]; N query heads share K key/value heads in
groups of G = N / K (grouped-query attention). The queries arrive already scaled (the model folds its softmax scale
into them, in float32, before the cast): no kernel here scales again.

Masks: causal always; `window` keeps keys with t - s < window (sliding-window layers); `segment_ids` [B, T] keeps
keys of the query's own document (packed rows: documents are contiguous, so row offsets are in-document offsets).
`softcap` squashes the logits to (-softcap, softcap) with tanh before the mask (Gemma 2). Every kernel takes the
softmax in float32 and weighs the values with probabilities in the compute dtype (splash: in float32).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# The decision is JAX-free, so the planner asks it too; it is re-exported here for the engine and the tests.
from extract.kernel_choice import (  # noqa: F401
    CUDNN, CUDNN_MAX_HEAD_DIM, KERNELS, MATERIALISED, SPLASH, XLA, AttentionUnavailable, Choice, choose_kernel,
    for_model,
)
from extract.sharding import DATA, MODEL

# Stands in for -inf in masked attention logits: exp() underflows to exactly 0 and no row is ever all-masked
# (a token always sees itself), so no NaN can appear.
_MASKED = float(np.finfo(np.float32).min)

#: Splash attention's key blocks must be multiples of the TPU's 128 lanes; rows are padded up to one.
SPLASH_LANES = 128


@dataclasses.dataclass(frozen=True)
class Binding:
    """The chosen kernel and what it needs from the engine: splash runs per device (`jax.shard_map`) over `mesh`,
    rows split over "data" and heads over "model" when both query and key/value heads are split there."""

    kernel: str
    mesh: Mesh | None = None
    heads_split: bool = False
    interpret: bool = False  # splash off a TPU (tests)


_binding: contextvars.ContextVar[Binding | None] = contextvars.ContextVar("attention_binding", default=None)


@contextlib.contextmanager
def use(binding: Binding) -> Iterator[None]:
    """Bind a kernel for the programs traced inside (JAX traces synchronously, so the binding is fixed in them)."""
    token = _binding.set(binding)
    try:
        yield
    finally:
        _binding.reset(token)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention of pre-scaled queries with the bound kernel (the oracle when none is bound)."""
    binding = _binding.get()
    kernel = binding.kernel if binding is not None else MATERIALISED
    if kernel == MATERIALISED:
        return materialised(q, k, v, window=window, segment_ids=segment_ids, softcap=softcap)
    if kernel == SPLASH:
        return splash(q, k, v, window=window, segment_ids=segment_ids, softcap=softcap, binding=binding)
    if softcap is not None:
        # The decision (choose_kernel) must have seen the model's softcap; reaching here is an engine bug.
        raise AttentionUnavailable(
            f"attention kernel {kernel!r} was chosen but the model soft-caps its logits (softcap={softcap}), "
            "which it cannot do: choose_kernel must be given the model's softcap"
        )
    return dot_product(q, k, v, window=window, segment_ids=segment_ids, implementation=kernel)


def materialised(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """The oracle: a [B, K, G, T, S] float32 logits tensor, masked with `where`, softmax, then the weighted sum."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    groups = n // kv_heads
    grouped = q.reshape(b, t, kv_heads, groups, h)
    # Scores and softmax in float32 whatever the compute dtype; the probabilities go back to it for the sum.
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", grouped, k, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if segment_ids is None:
        logits = jnp.where(attention_mask(t, window), logits, _MASKED)
    else:
        logits = jnp.where(packed_attention_mask(segment_ids, window)[:, None, None], logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    mixed = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return mixed.reshape(b, t, n, h)


def attention_mask(seq_len: int, window: int | None) -> jax.Array:
    """[T, S] boolean: key s is visible from query t when s <= t (and t - s < window for sliding layers)."""
    t = jnp.arange(seq_len)[:, None]
    s = jnp.arange(seq_len)[None, :]
    visible = s <= t
    if window is not None:
        visible &= t - s < window
    return visible


def packed_attention_mask(segment_ids: jax.Array, window: int | None) -> jax.Array:
    """[B, T, S] boolean for packed rows: causal (and windowed) within a document, nothing across documents."""
    return attention_mask(segment_ids.shape[1], window)[None] & same_document(segment_ids)


def same_document(segment_ids: jax.Array) -> jax.Array:
    """[B, T, S] boolean: query t and key s belong to the same document of their row."""
    return segment_ids[:, :, None] == segment_ids[:, None, :]


def dot_product(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str = CUDNN,
) -> jax.Array:
    """`jax.nn.dot_product_attention`: cuDNN flash attention on a GPU, or (`xla`) the same arguments on XLA.

    Causal is `is_causal`, which cuDNN uses to skip the masked blocks. A window is `local_window_size=(window - 1,
    0)`: t - s <= window - 1 (cuDNN's `sliding_window_length` = window). The API has no segment ids, so packed rows
    pass their same-document mask as `mask` ([B, 1, T, S], shared by the heads); cuDNN adds it as a bias, which is
    one [T, S] tile stream per row beside the flash kernel, far less than the materialised [B, N, T, S] logits.
    """
    mask = None if segment_ids is None else same_document(segment_ids)[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=1.0, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation,
    )  # fmt: skip


def splash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    softcap: float | None = None,
    binding: Binding | None = None,
) -> jax.Array:
    """Pallas splash attention, per device: rows over "data", heads over "model" where both head counts split.

    The kernel is a Mosaic call that XLA cannot partition, so it runs under `jax.shard_map`. Rows are padded to a
    multiple of 128 tokens; padded keys come after every real query, so the causal mask hides them, and padded
    queries (which see themselves) are dropped.
    """
    binding = binding or Binding(SPLASH, interpret=jax.default_backend() != "tpu")
    interpret = binding.interpret

    def per_device(q, k, v, segment_ids):
        return _splash_local(q, k, v, segment_ids, window=window, softcap=softcap, interpret=interpret)

    mesh = binding.mesh
    if mesh is None or mesh.size == 1:
        return per_device(q, k, v, segment_ids)
    heads = MODEL if binding.heads_split else None
    qkv = P(DATA, None, heads, None)
    rows = P(DATA, None)
    if segment_ids is None:
        mapped = jax.shard_map(
            lambda q, k, v: per_device(q, k, v, None), mesh=mesh, in_specs=(qkv, qkv, qkv), out_specs=qkv,
            check_vma=False,
        )  # fmt: skip
        return mapped(q, k, v)
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(qkv, qkv, qkv, rows), out_specs=qkv, check_vma=False)
    return mapped(q, k, v, segment_ids)


def _splash_local(q, k, v, segment_ids, *, window, softcap, interpret) -> jax.Array:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, n, h = q.shape
    padded = -(-t // SPLASH_LANES) * SPLASH_LANES
    if padded != t:
        pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - t)))
    kernel = _splash_kernel(padded, n, window, softcap, interpret)
    # Head-major, as the kernel takes them: [N, T, H] per row; key/value heads shared by groups of query heads.
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    if segment_ids is None:
        out = jax.vmap(kernel)(qt, kt, vt)
    else:
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(q=s, kv=s)))(
            qt, kt, vt, segment_ids
        )
    return jnp.swapaxes(out, 1, 2)[:, :t]


def _splash_kernel(seq_len: int, heads: int, window: int | None, softcap: float | None, interpret: bool):
    """A forward-only kernel (no backward blocks) for one padded length. Built inside the trace, not cached: it
    holds its block masks as arrays of the program being traced."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (seq_len, seq_len)
    head_mask = sa.CausalMask(shape) if window is None else sa.LocalMask(shape, (window - 1, 0), offset=0)
    block = next(size for size in (512, 256, SPLASH_LANES) if seq_len % size == 0)
    return sa.make_splash_mha(
        sa.MultiHeadMask([head_mask] * heads),
        block_sizes=sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block),
        head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret,
    )  # fmt: skip
