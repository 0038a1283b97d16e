"""Attention: one function the decoder layers call, whatever computes it.

`attend` is the only entry point. Today it has one implementation, the materialised einsum below: the readable
oracle that every faster kernel (cuDNN through `jax.nn.dot_product_attention`, Pallas splash attention on TPU) is
tested against, and the fallback where none applies. The choice of kernel belongs here, made once, never in the
layers.

Shapes: q [B, T, N, H], k and v [B, S, K, H], the result [B, T, N, H]; N query heads share K key/value heads in
groups of G = N / K (grouped-query attention). The queries arrive already scaled (the model folds its softmax scale
into them, in float32, before the cast): no kernel here scales again.

Masks: causal always; `window` keeps keys with t - s < window (sliding-window layers); `segment_ids` [B, T] keeps
keys of the query's own document (packed rows: documents are contiguous, so row offsets are in-document offsets).
`softcap` squashes the logits to (-softcap, softcap) with tanh before the mask (Gemma 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Stands in for -inf in masked attention logits: exp() underflows to exactly 0 and no row is ever all-masked
# (a token always sees itself), so no NaN can appear.
_MASKED = float(np.finfo(np.float32).min)


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
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return attention_mask(segment_ids.shape[1], window)[None] & same


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention of pre-scaled queries; the float32 softmax whatever the compute dtype."""
    return materialised(q, k, v, window=window, segment_ids=segment_ids, softcap=softcap)


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
