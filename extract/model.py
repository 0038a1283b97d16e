"""The decoder of every supported family in Flax NNX, truncated at the deepest activation the caller wants.

transformers has no Flax version of these models, so this is ours. One decoder covers Qwen2/2.5/3, Llama, Mistral
and Gemma 2/3: the blocks they share (attention with its options, the gated MLP, RMSNorm, RoPE) are written once,
and `ModelConfig` (extract/config.py) says which parts exist and how they behave. Per family, the differences are:

| family  | attention                                      | norms                              | MLP      | embedding |
|---------|------------------------------------------------|------------------------------------|----------|-----------|
| Qwen2   | q/k/v biases; windows from `max_window_layers` | pre-norms, w                       | SwiGLU   | as is     |
| Qwen3   | q/k RMSNorm; biases under `attention_bias`     | pre-norms, w                       | SwiGLU   | as is     |
| Llama   | biases under `attention_bias`                  | pre-norms, w                       | SwiGLU   | as is     |
| Mistral | every layer slides                             | pre-norms, w                       | SwiGLU   | as is     |
| Gemma 2 | soft-capped logits; query_pre_attn_scalar; alternating windows | pre- and post-norms, (1 + w) | GeGLU (tanh) | × sqrt(D) |
| Gemma 3 | q/k RMSNorm; query_pre_attn_scalar; 5 sliding : 1 global, local RoPE base | pre- and post-norms, (1 + w) | GeGLU (tanh) | × sqrt(D) |

There is no LM head and no KV cache: the model only ever runs one causal forward over a right-padded (or packed)
batch, and only as deep as needed.

Outputs (`keep`): hidden states by transformers' `output_hidden_states` index (an int: 0 the embeddings, i the output
of layer i, `num_hidden_layers` the final norm's output), and hook points (`HookPoint(site, layer)`, layer counted
from 0) inside a layer, named by `activations.format.SITES`:

    resid_pre -> attention_norm -> attention -> [attention_out_norm] = attn_out
    resid_mid = resid_pre + attn_out
    resid_mid -> mlp_norm = mlp_in -> act(gate) * up = mlp_hidden -> down -> [mlp_out_norm] = mlp_out
    resid_post = resid_mid + mlp_out

Only what `keep` names is returned; XLA drops what nobody uses.

Einsum letters: B batch, T query position, S key position, D hidden, N query heads, K key/value heads, G query heads
per key/value head, H head dim, F MLP intermediate, V vocabulary.

Every parameter carries a `role` (a field name of `ShardingRules`), so placement is data, not code in the layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from activations.format import HookPoint, Output
from extract.attention import attend
from extract.config import ModelConfig
from extract.rope import Rope
from extract.sharding import ShardingRules

_init = nnx.initializers.normal(stddev=0.02)

#: The MLP's gate activations (ModelConfig.activation); "gelu_tanh" is GELU's tanh approximation, as
#: transformers' `gelu_pytorch_tanh` computes it.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(_init(rngs.params(), shape, dtype), role=role)


def _ones(shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), role=role)


def _zeros(shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), role=role)


class RMSNorm(nnx.Module):
    """Normalise in float32. Llama's order (Qwen, Mistral): cast back to the input dtype, then scale by w. Gemma's
    (`plus_one`): scale by (1 + w) in float32, then cast; w starts at 0."""

    def __init__(self, dim: int, eps: float, dtype, plus_one: bool = False):
        self.scale = (_zeros if plus_one else _ones)((dim,), dtype, "replicated")
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...] * normed.astype(x.dtype)


def _norm(config: ModelConfig, dim: int, dtype) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, dtype, plus_one=config.norm_plus_one)


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

    `scale` folds the attention's softmax scale into the queries here, in float32, where it costs B*T*N*H multiplies
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
    def __init__(self, config: ModelConfig, window: int | None, dtype, rngs: nnx.Rngs):
        d, n, k, h = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = _param(rngs, (d, n, h), dtype, "q_proj")
        self.k_proj = _param(rngs, (d, k, h), dtype, "kv_proj")
        self.v_proj = _param(rngs, (d, k, h), dtype, "kv_proj")
        self.o_proj = _param(rngs, (n, h, d), dtype, "o_proj")
        self.q_bias = _zeros((n, h), dtype, "q_bias") if config.qkv_bias else None
        self.k_bias = _zeros((k, h), dtype, "kv_bias") if config.qkv_bias else None
        self.v_bias = _zeros((k, h), dtype, "kv_bias") if config.qkv_bias else None
        self.o_bias = _zeros((d,), dtype, "replicated") if config.o_bias else None
        self.q_norm = _norm(config, h, dtype) if config.qk_norm else None
        self.k_norm = _norm(config, h, dtype) if config.qk_norm else None
        self.window = window
        self.scale = config.query_scale
        self.softcap = config.attention_softcap

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...])
        k = jnp.einsum("BSD,DKH->BSKH", x, self.k_proj[...])
        v = jnp.einsum("BSD,DKH->BSKH", x, self.v_proj[...])
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, sin, cos, self.scale), apply_rope(k, sin, cos)
        mixed = attend(q, k, v, window=self.window, segment_ids=segment_ids, softcap=self.softcap)
        out = jnp.einsum("BTNH,NHD->BTD", mixed, self.o_proj[...])
        if self.o_bias is not None:
            out = out + self.o_bias[...]
        return out


class MLP(nnx.Module):
    """The gated MLP: down(act(gate(x)) * up(x)). Returns the output and the hidden activations act(gate) * up."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, (d, f), dtype, "mlp_in")
        self.up_proj = _param(rngs, (d, f), dtype, "mlp_in")
        self.down_proj = _param(rngs, (f, d), dtype, "mlp_out")
        self.activation = config.activation

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate_proj[...])
        up = jnp.einsum("BTD,DF->BTF", x, self.up_proj[...])
        hidden = ACTIVATIONS[self.activation](gate) * up
        return jnp.einsum("BTF,FD->BTD", hidden, self.down_proj[...]), hidden


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP, each added to the residual stream; Gemma also norms each one's output."""

    def __init__(self, config: ModelConfig, window: int | None, dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        self.attention_norm = _norm(config, d, dtype)
        self.attention = Attention(config, window, dtype, rngs)
        self.attention_out_norm = _norm(config, d, dtype) if config.sandwich_norms else None
        self.mlp_norm = _norm(config, d, dtype)
        self.mlp = MLP(config, dtype, rngs)
        self.mlp_out_norm = _norm(config, d, dtype) if config.sandwich_norms else None

    def __call__(
        self, x: jax.Array, sin: jax.Array, cos: jax.Array, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """Every site of this layer (activations.format.SITES) by name; the caller keeps what it needs."""
        sites = {"resid_pre": x}
        with jax.named_scope("attention"):
            attn_out = self.attention(self.attention_norm(x), sin, cos, segment_ids)
            if self.attention_out_norm is not None:
                attn_out = self.attention_out_norm(attn_out)
            sites["attn_out"] = attn_out
            sites["resid_mid"] = x = x + attn_out
        with jax.named_scope("mlp"):
            sites["mlp_in"] = self.mlp_norm(x)
            mlp_out, sites["mlp_hidden"] = self.mlp(sites["mlp_in"])
            if self.mlp_out_norm is not None:
                mlp_out = self.mlp_out_norm(mlp_out)
            sites["mlp_out"] = mlp_out
            sites["resid_post"] = x + mlp_out
        return sites


class DecoderModel(nnx.Module):
    """Embedding, the first `num_layers` decoder layers, and the final norm only when `num_layers` is the full stack.

    `__call__(token_ids, keep)` returns {output: activations} for each hidden-state index (int, transformers'
    `output_hidden_states` numbering) and hook point (`HookPoint`) in `keep`.
    """

    def __init__(
        self,
        config: ModelConfig,
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
        self.final_norm = _norm(config, config.hidden_size, dtype) if full_stack else None
        # Static: pins the residual stream to the batch split so XLA never gathers activations across "data".
        self.activation_sharding = NamedSharding(mesh, rules.activations) if mesh is not None and rules else None

    def _pin(self, x: jax.Array) -> jax.Array:
        if self.activation_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)

    def _rope_tables(self, token_ids, segment_ids, positions) -> dict[Rope, tuple[jax.Array, jax.Array]]:
        """sin, cos for each distinct RoPE of the built layers (Gemma 3 has two)."""
        ropes = {self.config.layer_rope(i) for i in range(len(self.layers))}
        if segment_ids is None:
            return {rope: rope_tables(token_ids.shape[1], rope) for rope in ropes}
        return {rope: packed_rope_tables(positions, rope) for rope in ropes}

    def __call__(
        self,
        token_ids: jax.Array,
        keep: Sequence[Output],
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> dict[Output, jax.Array]:
        """Packed rows pass `segment_ids` (the document of each token, [B, T]) and `positions` (its position within
        that document): attention stays inside a document and RoPE restarts at every document."""
        final_index = self.config.num_hidden_layers
        with jax.named_scope("embedding"):
            x = jnp.take(self.embedding[...], token_ids, axis=0)
            if self.config.embedding_scale:  # Gemma: sqrt(D) rounded to the compute dtype first, as transformers does
                x = x * jnp.asarray(self.config.hidden_size**0.5, dtype=x.dtype)
            x = self._pin(x)
        kept: dict[Output, jax.Array] = {0: x} if 0 in keep else {}
        tables = self._rope_tables(token_ids, segment_ids, positions)
        wanted = {(o.layer, o.site) for o in keep if isinstance(o, HookPoint)}
        for layer, block in enumerate(self.layers):
            sin, cos = tables[self.config.layer_rope(layer)]
            with jax.named_scope(f"layer_{layer + 1}"):
                sites = block(x, sin, cos, segment_ids)
            x = self._pin(sites["resid_post"])
            for site, value in sites.items():
                if (layer, site) in wanted:
                    kept[HookPoint(site, layer)] = self._pin(value)
            if layer + 1 in keep and layer + 1 != final_index:
                kept[layer + 1] = x
        if (len(self.layers), "resid_pre") in wanted:  # the input of a layer that is not built
            kept[HookPoint("resid_pre", len(self.layers))] = x
        if self.final_norm is not None and final_index in keep:
            with jax.named_scope("final_norm"):
                kept[final_index] = self._pin(self.final_norm(x))
        return kept


#: The name other modules were written against, when Qwen was the only family.
QwenModel = DecoderModel
