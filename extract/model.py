"""The decoder of every supported family in Flax NNX, truncated at the deepest activation the caller wants.

transformers has no Flax version of these models, so this is ours. One decoder covers every family
(extract/families.py, `FAMILIES`): the blocks they share (attention with its options, the gated and the plain MLP, the
norms, RoPE, learned positions) are written once, and `ModelConfig` says which parts exist and how they behave. Per
family, the differences are:

- GPT-2: q/k/v/o biases; norms before, LayerNorm with bias; plain MLP (GELU-tanh, biases); learned positions.
- GPT-NeoX: as GPT-2 but exact GELU, attention and MLP in parallel, partial RoPE.
- Llama, Mistral (every layer slides), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm): norms before, w;
  SwiGLU; RoPE.
- Phi-3: as Llama, with partial RoPE and LongRoPE (fused qkv and gate_up tensors are split at load).
- OLMo 2: norms after the sublayers only, w in float32; q/k RMSNorm over all heads at once; SwiGLU; RoPE.
- Gemma 1: norms before, (1 + w); GeGLU (tanh); RoPE; embeddings x sqrt(D).
- Gemma 2: as Gemma 1 with norms around the sublayers, soft-capped logits, query_pre_attn_scalar, alternating
  windows. Gemma 3: as Gemma 2 with per-head q/k RMSNorm, 5 sliding : 1 global layers and a local RoPE base.

There is no LM head and no KV cache: the model only ever runs one causal forward over a right-padded (or packed)
batch, and only as deep as needed.

Outputs (`keep`): hidden states by transformers' `output_hidden_states` index (an int: 0 the embeddings, i the output
of layer i, `num_hidden_layers` the final norm's output), and hook points (`HookPoint(site, layer)`, layer counted
from 0) inside a layer, named by `activations.format.SITES`. With the norms `before` the sublayers ([...] marks the
norms `around` adds; `after` keeps only those, the sublayers reading the residual stream itself):

    resid_pre -> attention_norm -> attention -> [attention_out_norm] = attn_out
    resid_mid = resid_pre + attn_out
    resid_mid -> mlp_norm = mlp_in -> MLP (its hidden activations: mlp_hidden) -> [mlp_out_norm] = mlp_out
    resid_post = resid_mid + mlp_out

In parallel (NeoX), attention and MLP both read resid_pre: mlp_in = mlp_norm(resid_pre), resid_post = resid_pre +
attn_out + mlp_out, and there is no resid_mid. Only what `keep` names is returned; XLA drops what nobody uses.

Rounding follows the references': norms, RoPE and the activation functions compute in float32 and round to the
compute dtype once; matmuls and residual additions run in the compute dtype.

Einsum letters: B batch, T query position, S key position, D hidden, N query heads, K key/value heads, G query heads
per key/value head, H head dim, F MLP intermediate, V vocabulary, P positions.

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
from extract.experts import Moe
from extract.rope import Rope
from extract.sharding import ShardingRules

_init = nnx.initializers.normal(stddev=0.02)

#: The MLP's activation functions (ModelConfig.activation) in float32; "gelu_tanh" is GELU's tanh approximation
#: (transformers' `gelu_pytorch_tanh`, and its `gelu_new`).
_FUNCTIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def _rounded_once(function):
    def activation(x: jax.Array) -> jax.Array:
        return function(x.astype(jnp.float32)).astype(x.dtype)

    return activation


#: name -> act(x), computed in float32 and rounded to x's dtype once, as PyTorch's kernels compute transformers'
#: activations (in bf16 arithmetic, GELU-tanh would round at each of its steps).
ACTIVATIONS = {name: _rounded_once(function) for name, function in _FUNCTIONS.items()}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(_init(rngs.params(), shape, dtype), role=role)


def _ones(shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), role=role)


def _zeros(shape: tuple[int, ...], dtype, role: str) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), role=role)


class Norm(nnx.Module):
    """One norm over the last `len(shape)` axes (`ModelConfig.norm`, extract/config.py's NORMS), in float32:

    - `rms`: normalise, cast back to the input dtype, then times w (Llama's order: Qwen, Mistral, Phi-3);
    - `rms_scale_in_float32`: times w in float32, then cast (OLMo 2);
    - `rms_one_plus`: times (1 + w) in float32, then cast; w starts at 0 (Gemma);
    - `layer_norm`: subtract the mean, divide by the standard deviation, times w plus b in float32, then cast
      (GPT-2, NeoX: PyTorch's LayerNorm kernel rounds once).
    """

    def __init__(self, shape: tuple[int, ...], kind: str, eps: float, dtype, role: str = "replicated"):
        self.scale = (_zeros if kind == "rms_one_plus" else _ones)(shape, dtype, role)
        self.bias = _zeros(shape, dtype, role) if kind == "layer_norm" else None
        self.kind, self.eps, self.axes = kind, eps, tuple(range(-len(shape), 0))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        if self.kind == "layer_norm":
            x32 = x32 - jnp.mean(x32, axis=self.axes, keepdims=True)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=self.axes, keepdims=True) + self.eps)
        if self.kind == "rms":
            return self.scale[...] * normed.astype(x.dtype)
        scale = self.scale[...].astype(jnp.float32)
        if self.kind == "rms_one_plus":
            return (normed * (1.0 + scale)).astype(x.dtype)
        if self.kind == "layer_norm":
            return (normed * scale + self.bias[...].astype(jnp.float32)).astype(x.dtype)
        return (normed * scale).astype(x.dtype)


def _norm(config: ModelConfig, shape: tuple[int, ...], dtype, role: str = "replicated") -> Norm:
    return Norm(shape, config.norm, config.norm_eps, dtype, role)


def rope_tables(seq_len: int, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """sin, cos of shape [T, R/2] in float32 for positions 0..T-1 (right padding keeps positions from 0); R is the
    rotated part of a head (`Rope.rotary_dim`)."""
    return packed_rope_tables(jnp.arange(seq_len), rope)


def packed_rope_tables(positions: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """sin, cos of shape [..., R/2] in float32 for the positions' shape ([T], or [B, T] for packed rows, whose
    positions restart at 0 per document). Both carry the RoPE's attention scaling (YaRN's, LongRoPE's), as
    transformers' do."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inverse_frequency_array())
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if rope.attention_scaling != 1.0:
        sin, cos = sin * rope.attention_scaling, cos * rope.attention_scaling
    return sin, cos


def apply_rope(x: jax.Array, sin: jax.Array | None, cos: jax.Array | None, scale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE on [B, T, heads, H], computed in float32 so bf16 runs do not round the angles. Only the
    first R values of each head rotate (R = 2 * sin.shape[-1]; all of H but for a partial RoPE); the rest pass
    through. No tables (a model without RoPE): only the scale.

    `scale` folds the attention's softmax scale into the queries here, in float32, where it costs B*T*N*H multiplies
    instead of B*N*T*S on the scores.
    """
    x32 = x.astype(jnp.float32)
    if sin is not None:
        half = sin.shape[-1]
        x1, x2, passed = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
        if sin.ndim == 2:  # [T, R/2], shared by every row
            sin, cos = sin[None, :, None, :], cos[None, :, None, :]
        else:  # [B, T, R/2], per-row positions of packed documents
            sin, cos = sin[:, :, None, :], cos[:, :, None, :]
        x32 = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed], axis=-1)
    return (x32 * scale if scale != 1.0 else x32).astype(x.dtype)


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
        # q/k norms: per head ([H], shared by the heads), or over the whole projection ([heads, H], OLMo 2).
        q_norm, k_norm = {
            "head": (((h,), "replicated"), ((h,), "replicated")),
            "projection": (((n, h), "q_bias"), ((k, h), "kv_bias")),
        }.get(config.qk_norm, (None, None))
        self.q_norm = _norm(config, q_norm[0], dtype, q_norm[1]) if q_norm else None
        self.k_norm = _norm(config, k_norm[0], dtype, k_norm[1]) if k_norm else None
        self.window = window
        self.scale = config.query_scale
        self.softcap = config.attention_softcap

    def __call__(self, x: jax.Array, sin, cos, segment_ids: jax.Array | None = None) -> jax.Array:
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
    """`gated`: down(act(gate x) * up x); `plain`: down(act(up x + b)) + b (ModelConfig.mlp). Returns the output
    and the hidden activations (what goes into the down-projection)."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = _param(rngs, (d, f), dtype, "mlp_in") if config.mlp == "gated" else None
        self.up_proj = _param(rngs, (d, f), dtype, "mlp_in")
        self.down_proj = _param(rngs, (f, d), dtype, "mlp_out")
        self.up_bias = _zeros((f,), dtype, "mlp_bias") if config.mlp_bias else None
        self.down_bias = _zeros((d,), dtype, "replicated") if config.mlp_bias else None
        self.activation = config.activation

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        up = jnp.einsum("BTD,DF->BTF", x, self.up_proj[...])
        if self.up_bias is not None:
            up = up + self.up_bias[...]
        if self.gate_proj is not None:
            hidden = ACTIVATIONS[self.activation](jnp.einsum("BTD,DF->BTF", x, self.gate_proj[...])) * up
        else:
            hidden = ACTIVATIONS[self.activation](up)
        out = jnp.einsum("BTF,FD->BTD", hidden, self.down_proj[...])
        if self.down_bias is not None:
            out = out + self.down_bias[...]
        return out, hidden


class Experts(nnx.Module):
    """A mixture's SwiGLU experts, stacked: gate and up [E, D, F], down [E, F, D] (E experts, F each one's width)."""

    def __init__(self, config: ModelConfig, num_experts: int, size: int, dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        self.gate_proj = _param(rngs, (num_experts, d, size), dtype, "expert_in")
        self.up_proj = _param(rngs, (num_experts, d, size), dtype, "expert_in")
        self.down_proj = _param(rngs, (num_experts, size, d), dtype, "expert_out")


class MoeBlock(nnx.Module):
    """A mixture of experts in place of the MLP (`ModelConfig.moe`, routing as extract/experts.py states it): the
    router picks each token's `top_k` experts, whose outputs are added, each times its weight; a Qwen2-MoE shared
    expert adds its output times sigmoid(x · w) for every token. Returns the block's output, the router's logits and
    the weight each expert got ([B, T, E], zero where not chosen).

    Every expert runs on every token and the experts not chosen are weighted by an exact zero: no token is ever
    dropped for capacity, the result is transformers' (an unchosen expert adds 0, exactly), and the experts split
    over the mesh like any other tensor. It costs num_experts / top_k times the chosen experts' arithmetic."""

    def __init__(self, config: ModelConfig, moe: Moe, dtype, rngs: nnx.Rngs):
        self.router = _param(rngs, (config.hidden_size, moe.num_experts), dtype, "router")
        self.experts = Experts(config, moe.num_experts, moe.expert_size, dtype, rngs)
        shared = moe.shared_expert_size
        self.shared_expert = MLP(config, dtype, rngs, intermediate_size=shared) if shared else None
        self.shared_expert_gate = _param(rngs, (config.hidden_size, 1), dtype, "replicated") if shared else None
        self.moe, self.activation = moe, config.activation

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The router's logits [B, T, E], each expert's weight [B, T, E] (zero where not chosen), and the chosen
        experts' indices [B, T, K], the heaviest first (int32)."""
        logits = jnp.einsum("BTD,DE->BTE", x, self.router[...])
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        # Ties go to the higher expert index, as torch.topk on CPU breaks them (extract/experts.py): top_k prefers the
        # lower index, so it runs over the experts in reverse.
        top, reversed_chosen = jax.lax.top_k(probs[..., ::-1], self.moe.top_k)
        chosen = self.moe.num_experts - 1 - reversed_chosen
        # ... and lists experts of equal weight in ascending index order, as torch.topk on CPU does (the order of
        # `expert_indices`): by index first, then a stable sort by weight, heaviest first.
        by_index = jnp.argsort(chosen, axis=-1)
        chosen, top = jnp.take_along_axis(chosen, by_index, -1), jnp.take_along_axis(top, by_index, -1)
        by_weight = jnp.argsort(-top, axis=-1, stable=True)
        chosen, top = jnp.take_along_axis(chosen, by_weight, -1), jnp.take_along_axis(top, by_weight, -1)
        if self.moe.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        if not self.moe.float32_weights:
            top = top.astype(x.dtype)
        one_hot = jax.nn.one_hot(chosen, self.moe.num_experts, dtype=top.dtype)  # [B, T, K, E]
        return logits, jnp.einsum("BTK,BTKE->BTE", top, one_hot), chosen

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The block's output and the router's sites by name (`router_logits`, `expert_weights`, `expert_indices`)."""
        logits, weights, chosen = self.route(x)
        gate = jnp.einsum("BTD,EDF->BTEF", x, self.experts.gate_proj[...])
        up = jnp.einsum("BTD,EDF->BTEF", x, self.experts.up_proj[...])
        hidden = ACTIVATIONS[self.activation](gate) * up
        # transformers weights each expert's output after its down-projection; weighting its hidden activations
        # first is the same sum (the weight is a scalar per token and expert) without a [B, T, E, D] tensor.
        weighted = (hidden * weights[..., None]).astype(x.dtype)
        out = jnp.einsum("BTEF,EFD->BTD", weighted, self.experts.down_proj[...])
        if self.shared_expert is not None:
            shared, _ = self.shared_expert(x)
            gate_value = jax.nn.sigmoid(jnp.einsum("BTD,DO->BTO", x, self.shared_expert_gate[...]))
            out = out + gate_value * shared
        return out, {"router_logits": logits, "expert_weights": weights, "expert_indices": chosen}


class DecoderLayer(nnx.Module):
    """Attention and MLP, each added to the residual stream, with the norms where the family puts them
    (`ModelConfig.norm_position`: the norms of `NORM_POSITIONS`), one after the other or in parallel (NeoX)."""

    def __init__(self, config: ModelConfig, window: int | None, dtype, rngs: nnx.Rngs, moe: Moe | None = None):
        norms = config.layer_norms

        def norm(name: str) -> Norm | None:
            return _norm(config, (config.hidden_size,), dtype) if name in norms else None

        self.attention_norm = norm("attention_norm")
        self.attention = Attention(config, window, dtype, rngs)
        self.attention_out_norm = norm("attention_out_norm")
        self.mlp_norm = norm("mlp_norm")
        self.mlp = MLP(config, dtype, rngs) if moe is None else MoeBlock(config, moe, dtype, rngs)
        self.mlp_out_norm = norm("mlp_out_norm")
        self.parallel = config.parallel_residual

    @staticmethod
    def _maybe(norm: Norm | None, x: jax.Array) -> jax.Array:
        return x if norm is None else norm(x)

    def __call__(
        self, x: jax.Array, sin, cos, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """Every site of this layer (activations.format.SITES; no resid_mid in parallel) by name; the caller keeps
        what it needs."""
        sites = {"resid_pre": x}
        with jax.named_scope("attention"):
            attn_out = self.attention(self._maybe(self.attention_norm, x), sin, cos, segment_ids)
            sites["attn_out"] = attn_out = self._maybe(self.attention_out_norm, attn_out)
            if not self.parallel:
                sites["resid_mid"] = x = x + attn_out
        with jax.named_scope("mlp"):
            sites["mlp_in"] = self._maybe(self.mlp_norm, x)
            if isinstance(self.mlp, MoeBlock):
                mlp_out, router = self.mlp(sites["mlp_in"])
                sites.update(router)
            else:
                mlp_out, sites["mlp_hidden"] = self.mlp(sites["mlp_in"])
            sites["mlp_out"] = mlp_out = self._maybe(self.mlp_out_norm, mlp_out)
            # NeoX adds mlp_out + attn_out first, then the residual (GPTNeoXLayer): the same order, the same rounding.
            sites["resid_post"] = (mlp_out + attn_out) + x if self.parallel else x + mlp_out
        return sites


class DecoderModel(nnx.Module):
    """Embedding (and GPT-2's position table), the first `num_layers` decoder layers, and the final norm only when
    `num_layers` is the full stack.

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
        d = config.hidden_size
        self.embedding = _param(rngs, (config.vocab_size, d), dtype, "embedding")
        self.position_embedding = (
            _param(rngs, (config.position_table, d), dtype, "embedding") if config.position_table else None
        )
        self.layers = nnx.List(
            [DecoderLayer(config, config.sliding_windows[i], dtype, rngs, config.moe_layer(i)) for i in range(num_layers)]
        )
        full_stack = num_layers == config.num_hidden_layers
        self.final_norm = _norm(config, (d,), dtype) if full_stack else None
        # Static: pins the residual stream to the batch split so XLA never gathers activations across "data".
        self.activation_sharding = NamedSharding(mesh, rules.activations) if mesh is not None and rules else None

    def _pin(self, x: jax.Array) -> jax.Array:
        if self.activation_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)

    def _rope_tables(self, token_ids, segment_ids, positions) -> dict[Rope | None, tuple]:
        """sin, cos for each distinct RoPE of the built layers (Gemma 3 has two; a model without RoPE none)."""
        ropes = {self.config.layer_rope(i) for i in range(len(self.layers))}
        tables: dict[Rope | None, tuple] = {None: (None, None)}
        for rope in ropes - {None}:
            tables[rope] = (
                rope_tables(token_ids.shape[1], rope) if segment_ids is None else packed_rope_tables(positions, rope)
            )
        return tables

    def __call__(
        self,
        token_ids: jax.Array,
        keep: Sequence[Output],
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> dict[Output, jax.Array]:
        """Packed rows pass `segment_ids` (the document of each token, [B, T]) and `positions` (its position within
        that document): attention stays inside a document and positions restart at every document."""
        final_index = self.config.num_hidden_layers
        with jax.named_scope("embedding"):
            x = jnp.take(self.embedding[...], token_ids, axis=0)
            if self.position_embedding is not None:  # GPT-2: the learned position table, added
                where = jnp.arange(token_ids.shape[1]) if segment_ids is None else positions
                x = x + jnp.take(self.position_embedding[...], where, axis=0)
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
