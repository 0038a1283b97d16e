"""The Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, truncated at the deepest hidden state the caller wants.

transformers has no Flax Qwen, so this is ours. One module covers the family; `QwenConfig` says which parts exist:
q/k/v biases (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), an output bias (Qwen3 with attention_bias), sliding
windows per layer. There is no LM head and no KV cache: the model only ever runs one causal forward over a
right-padded batch, and only as deep as needed.

Einsum letters: B batch, T query position, S key position, D hidden, N query heads, K key/value heads, G query heads
per key/value head, H head dim, F MLP intermediate, V vocabulary.

Every parameter carries a `role` (a field name of `ShardingRules`), so placement is data, not code in the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from extract.attention import attend
from extract.config import QwenConfig
from extract.rope import Rope
from extract.sharding import ShardingRules

_init = nnx.initializers.normal(stddev=0.02)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(_init(rngs.params(), shape, dtype), role=role)


def _ones(shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), role=role)


def _zeros(shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), role=role)


class RMSNorm(nnx.Module):
    """Normalise in float32, cast back to the input dtype, then scale: the order Qwen's reference uses."""

    def __init__(self, dim: int, eps: float, dtype):
        self.scale = _ones((dim,), dtype, "replicated")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rope_tables(seq_len: int, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """sin, cos of shape [T, H/2] in float32 for positions 0..T-1 (right padding keeps positions from 0)."""
    return packed_rope_tables(jnp.arange(seq_len), rope)


def packed_rope_tables(positions: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """sin, cos of shape [..., H/2] in float32 for the positions' shape ([T], or [B, T] for packed rows, whose
    positions restart at 0 per document). Both carry the RoPE's attention scaling (YaRN's), as transformers' do."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inverse_frequency_array())
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if rope.attention_scaling != 1.0:
        sin, cos = sin * rope.attention_scaling, cos * rope.attention_scaling
    return sin, cos


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE on [B, T, heads, H], computed in float32 so bf16 runs do not round the angles.

    `scale` folds the attention's 1/sqrt(H) into the queries here, in float32, where it costs B*T*N*H multiplies
    instead of B*N*T*S on the scores.
    """
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    if sin.ndim == 2:  # [T, H/2], shared by every row
        sin, cos = sin[None, :, None, :], cos[None, :, None, :]
    else:  # [B, T, H/2], per-row positions of packed documents
        sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return (rotated * scale if scale != 1.0 else rotated).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: QwenConfig, window: int | None, dtype, rngs: nnx.Rngs):
        d, n, k, h = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = _param(rngs, (d, n, h), dtype, "q_proj")
        self.k_proj = _param(rngs, (d, k, h), dtype, "kv_proj")
        self.v_proj = _param(rngs, (d, k, h), dtype, "kv_proj")
        self.o_proj = _param(rngs, (n, h, d), dtype, "o_proj")
        self.q_bias = _zeros((n, h), dtype, "q_bias") if config.qkv_bias else None
        self.k_bias = _zeros((k, h), dtype, "kv_bias") if config.qkv_bias else None
        self.v_bias = _zeros((k, h), dtype, "kv_bias") if config.qkv_bias else None
        self.o_bias = _zeros((d,), dtype, "replicated") if config.o_bias else None
        self.q_norm = RMSNorm(h, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(h, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.window = window
        self.scale = config.head_dim**-0.5

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...])
        k = jnp.einsum("BSD,DKH->BSKH", x, self.k_proj[...])
        v = jnp.einsum("BSD,DKH->BSKH", x, self.v_proj[...])
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, sin, cos, self.scale), apply_rope(k, sin, cos)
        mixed = attend(q, k, v, window=self.window, segment_ids=segment_ids)
        out = jnp.einsum("BTNH,NHD->BTD", mixed, self.o_proj[...])
        if self.o_bias is not None:
            out = out + self.o_bias[...]
        return out


class MLP(nnx.Module):
    def __init__(self, config: QwenConfig, dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, (d, f), dtype, "mlp_in")
        self.up_proj = _param(rngs, (d, f), dtype, "mlp_in")
        self.down_proj = _param(rngs, (f, d), dtype, "mlp_out")

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate_proj[...])
        up = jnp.einsum("BTD,DF->BTF", x, self.up_proj[...])
        return jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_proj[...])


class DecoderLayer(nnx.Module):
    def __init__(self, config: QwenConfig, window: int | None, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attention = Attention(config, window, dtype, rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        with jax.named_scope("attention"):
            x = x + self.attention(self.input_norm(x), sin, cos, segment_ids)
        with jax.named_scope("mlp"):
            return x + self.mlp(self.post_attention_norm(x))


class QwenModel(nnx.Module):
    """Embedding, the first `num_layers` decoder layers, and the final norm only when `num_layers` is the full stack.

    `__call__(token_ids, keep)` returns {index: hidden state} in transformers' `output_hidden_states` numbering:
    0 is the embedding output, i the output of layer i, `config.num_hidden_layers` the final-norm output.
    """

    def __init__(
        self,
        config: QwenConfig,
        num_layers: int,
        dtype,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
    ):
        if not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers} outside 0..{config.num_hidden_layers}")
        self.config = config
        self.embedding = _param(rngs, (config.vocab_size, config.hidden_size), dtype, "embedding")
        self.layers = nnx.List(
            [DecoderLayer(config, config.sliding_windows[i], dtype, rngs) for i in range(num_layers)]
        )
        full_stack = num_layers == config.num_hidden_layers
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if full_stack else None
        # Static: pins the residual stream to the batch split so XLA never gathers activations across "data".
        self.activation_sharding = NamedSharding(mesh, rules.activations) if mesh is not None and rules else None

    def _pin(self, x: jax.Array) -> jax.Array:
        if self.activation_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)

    def __call__(
        self,
        token_ids: jax.Array,
        keep: tuple[int, ...],
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> dict[int, jax.Array]:
        """Packed rows pass `segment_ids` (the document of each token, [B, T]) and `positions` (its position within
        that document): attention stays inside a document and RoPE restarts at every document."""
        final_index = self.config.num_hidden_layers
        with jax.named_scope("embedding"):
            x = self._pin(jnp.take(self.embedding[...], token_ids, axis=0))
        hidden = {0: x} if 0 in keep else {}
        if segment_ids is None:
            sin, cos = rope_tables(token_ids.shape[1], self.config.rope)
        else:
            sin, cos = packed_rope_tables(positions, self.config.rope)
        for index, layer in enumerate(self.layers, start=1):
            with jax.named_scope(f"layer_{index}"):
                x = self._pin(layer(x, sin, cos, segment_ids))
            if index in keep and index != final_index:
                hidden[index] = x
        if self.final_norm is not None and final_index in keep:
            with jax.named_scope("final_norm"):
                hidden[final_index] = self._pin(self.final_norm(x))
        return hidden
