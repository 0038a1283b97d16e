"""Which step of the attention puts our float32 error above transformers': each intermediate of one Qwen3 attention
layer at Qwen3-30B-A3B's attention width (hidden 2,048, 32 heads of 128, 4 key/value heads, per-head q/k RMSNorm,
RoPE theta 1e6), ours (extract.model's own functions, jitted at HIGHEST as the engine traces a float32 job, the two
samples right-padded into one batch as the engine runs them) and transformers' float32, against transformers'
float64 chain of the same weights (its norms, RoPE tables and softmax run in float32 there too, as its code does).

Per step, max |x - float64| / max |float64| over the valid tokens, ours / transformers', and their ratio:
- chained: each side's own forward up to that step;
- local: the step alone, fed float64's input of that step rounded to float32 (what the step itself adds).

    PYTHONPATH=. python bench/attention_steps.py                   # XLA's defaults
    PYTHONPATH=. python bench/attention_steps.py --without-ynnpack # the options a float32 engine compiles with

The weights are those bench/parity_table.py's real widths draw (tests/extract_model/families.py), and the torch
chain is checked against transformers' own module outputs (hooks) before anything is printed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
             max_position_embeddings=40960, rope_theta=1e6, vocab_size=256, num_hidden_layers=1,
             intermediate_size=64)  # fmt: skip
STEPS = ["normed", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "weighted values", "attn_out"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--without-ynnpack", action="store_true", help="compile as a float32 engine does on a CPU")
    args = parser.parse_args()
    if args.without_ynnpack:  # before JAX opens its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type=").strip()
    import numpy as np
    import torch

    from activations.format import HookPoint
    from tests.extract_model.families import REAL_LENGTHS, reference_outputs, write_family_model

    model = write_family_model(pathlib.Path(tempfile.mkdtemp()), "qwen3", seed=3, shard_size=None, base={}, **SHAPE)
    rng = np.random.default_rng(0)  # the samples of test_family_parity.references
    samples = [rng.integers(1, SHAPE["vocab_size"], n).tolist() for n in REAL_LENGTHS]
    layer = model.torch_model.model.layers[0]
    weights = {
        "embedding": model.torch_model.model.embed_tokens.weight.detach(),
        "norm": layer.input_layernorm.weight.detach(),
        "q_norm": layer.self_attn.q_norm.weight.detach(),
        "k_norm": layer.self_attn.k_norm.weight.detach(),
        **{name: getattr(layer.self_attn, name).weight.detach() for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
    }
    wide = [torch_steps(weights, s, torch.float64) for s in samples]
    narrow = [torch_steps(weights, s, torch.float32) for s in samples]
    narrow_local = [torch_steps(weights, s, torch.float32, wide[i]) for i, s in enumerate(samples)]
    for dtype, chains in ((torch.float64, wide), (torch.float32, narrow)):  # the chain is transformers' own
        import copy

        for sample, chain in zip(samples, chains):
            hooked = reference_outputs(copy.deepcopy(model.torch_model).to(dtype), sample, 1)
            assert np.array_equal(hooked[HookPoint("attn_out", 0)], chain["attn_out"].double().numpy()), dtype
    ours, ours_local = our_steps(weights, samples), our_steps(weights, samples, wide)

    def error(values, step: str) -> float:
        scale = max(float(np.abs(w[step].double().numpy()).max()) for w in wide)
        return max(float(np.abs(np.asarray(v, np.float64) - w[step].double().numpy()).max()) / scale
                   for v, w in zip(values, wide))  # fmt: skip

    print(f"XLA options: {'without YNNPACK' if args.without_ynnpack else 'defaults'}\n")
    print("| step | chained: ours / transformers' | ratio | local: ours / transformers' | ratio |")
    print("|---|---|---|---|---|")
    for step in STEPS:
        chained = error([o[step] for o in ours], step), error([n[step].double().numpy() for n in narrow], step)
        local = (error([o[step] for o in ours_local], step),
                 error([n[step].double().numpy() for n in narrow_local], step))  # fmt: skip
        print(f"| {step} | {chained[0]:.2e} / {chained[1]:.2e} | {chained[0] / chained[1]:.2f} "
              f"| {local[0]:.2e} / {local[1]:.2e} | {local[0] / local[1]:.2f} |")  # fmt: skip


def torch_steps(weights: dict, tokens: list[int], dtype, inputs: dict | None = None) -> dict:
    """transformers' Qwen3 attention (5.24: `Qwen3RMSNorm`, `Qwen3RotaryEmbedding`, `eager_attention_forward`) step by
    step in `dtype`; with `inputs`, each step reads that chain's input of the step instead of its own."""
    import torch

    def fed(step, value):
        return value if inputs is None else inputs[step].to(dtype)

    def rms(x, weight, eps=SHAPE["rms_norm_eps"]):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight.to(dtype) * h.to(dtype)

    t, n, k, h = len(tokens), SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    w = {name: value.to(dtype) for name, value in weights.items() if name.endswith("proj")}
    s = {"x": weights["embedding"][tokens].to(dtype)}
    s["normed"] = rms(s["x"], weights["norm"])
    x = fed("normed", s["normed"])
    for name, heads in (("q", n), ("k", k), ("v", k)):
        s[name] = (x @ w[f"{name}_proj"].T).view(t, heads, h)
    s["q_norm"], s["k_norm"] = rms(fed("q", s["q"]), weights["q_norm"]), rms(fed("k", s["k"]), weights["k_norm"])
    inverse = 1.0 / (SHAPE["rope_theta"] ** (torch.arange(0, h, 2, dtype=torch.int64).to(torch.float) / h))
    angles = torch.arange(t)[:, None].float() * inverse[None]
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]

    def rotate(x):
        return x * cos + torch.cat((-x[..., h // 2 :], x[..., : h // 2]), -1) * sin

    s["q_rope"], s["k_rope"] = rotate(fed("q_norm", s["q_norm"])), rotate(fed("k_norm", s["k_norm"]))
    q = fed("q_rope", s["q_rope"]).transpose(0, 1)
    keys = fed("k_rope", s["k_rope"]).transpose(0, 1).repeat_interleave(n // k, 0)
    values = fed("v", s["v"]).transpose(0, 1).repeat_interleave(n // k, 0)
    scores = (q @ keys.transpose(1, 2)) * h**-0.5 + torch.triu(torch.full((t, t), -torch.inf), 1).to(dtype)
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(dtype)
    s["weighted values"] = (probs @ values).transpose(0, 1)
    s["attn_out"] = fed("weighted values", s["weighted values"]).reshape(t, n * h) @ w["o_proj"].T
    return s


def our_steps(weights: dict, samples: list[list[int]], inputs: list[dict] | None = None) -> list[dict]:
    """Our attention (extract.model's Norm, rope_tables, apply_rope, extract.attention's oracle and the einsums of
    `Attention.__call__`) step by step on the samples right-padded into one batch, each step jitted at HIGHEST;
    with `inputs` (per sample), each step reads float64's input of the step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from extract.attention import materialised
    from extract.model import Norm, apply_rope, rope_tables
    from extract.rope import read_rope

    b, t = len(samples), max(map(len, samples))
    d, n, k, h = (SHAPE[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))

    def padded(step: str, shape: tuple[int, ...]):
        batch = np.zeros((b, t, *shape), np.float32)
        for row, sample in enumerate(samples):
            batch[row, : len(sample)] = inputs[row][step].numpy().reshape(len(sample), *shape)
        return jnp.asarray(batch)

    def fed(step, value, shape):
        return value if inputs is None else padded(step, shape)

    def norm(weight):
        module = Norm(tuple(weight.shape), "rms", SHAPE["rms_norm_eps"], jnp.float32)
        module.scale.value = jnp.asarray(weight.numpy())
        return module

    def projection(name, heads, transpose=False):
        value = weights[name].numpy().T  # [in, out]
        return jnp.asarray(value.reshape(heads, h, d) if transpose else value.reshape(d, heads, h))

    q_w, k_w, v_w = projection("q_proj", n), projection("k_proj", k), projection("v_proj", k)
    o_w = projection("o_proj", n, transpose=True)
    norms = {name: norm(weights[name]) for name in ("norm", "q_norm", "k_norm")}
    tokens = np.zeros((b, t), np.int32)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample)] = sample
    s = {}
    with jax.default_matmul_precision("highest"):
        sin, cos = rope_tables(t, read_rope({"rope_theta": SHAPE["rope_theta"]}, h))
        s["normed"] = jax.jit(lambda x: norms["norm"](x))(jnp.asarray(weights["embedding"].numpy())[tokens])
        x = fed("normed", s["normed"], (d,))
        s["q"] = jax.jit(lambda x: jnp.einsum("BTD,DNH->BTNH", x, q_w))(x)
        s["k"] = jax.jit(lambda x: jnp.einsum("BSD,DKH->BSKH", x, k_w))(x)
        s["v"] = jax.jit(lambda x: jnp.einsum("BSD,DKH->BSKH", x, v_w))(x)
        s["q_norm"] = jax.jit(lambda x: norms["q_norm"](x))(fed("q", s["q"], (n, h)))
        s["k_norm"] = jax.jit(lambda x: norms["k_norm"](x))(fed("k", s["k"], (k, h)))
        s["q_rope"] = jax.jit(lambda x: apply_rope(x, sin, cos))(fed("q_norm", s["q_norm"], (n, h)))
        s["k_rope"] = jax.jit(lambda x: apply_rope(x, sin, cos))(fed("k_norm", s["k_norm"], (k, h)))
        # The model folds the softmax scale into the queries with the rotation; here it scales the rotated queries.
        s["weighted values"] = jax.jit(lambda q, k, v: materialised(apply_rope(q, None, None, h**-0.5), k, v))(
            fed("q_rope", s["q_rope"], (n, h)), fed("k_rope", s["k_rope"], (k, h)), fed("v", s["v"], (k, h)))
        s["attn_out"] = jax.jit(lambda m: jnp.einsum("BTNH,NHD->BTD", m, o_w))(
            fed("weighted values", s["weighted values"], (n, h)))
    return [{step: np.asarray(value, np.float64)[row, : len(sample)].reshape(inputs_shape(step, len(sample)))
             for step, value in s.items()} for row, sample in enumerate(samples)]  # fmt: skip


def inputs_shape(step: str, length: int) -> tuple[int, ...]:
    """The shape of a step's values in the torch chain (what the errors compare against)."""
    n, k, h, d = (SHAPE[key] for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size"))
    if step in ("normed", "attn_out"):
        return (length, d)
    return (length, k if step in ("k", "v", "k_norm", "k_rope") else n, h)


if __name__ == "__main__":
    sys.exit(main())
