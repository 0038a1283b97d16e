"""Parity with transformers on whatever devices are present (a GPU or TPU host: the accelerator kernels; a CPU: the
same script at a small shape), in float32 and bf16, plain and packed rows. It prints figures and checks them
against docs/MODEL.md's bounds; exit 1 if any is missed.

transformers' forward runs on CUDA when torch sees a GPU (float32 with TF32 off, so it is a float32 reference),
else on the CPU; its float64 forward (the float32 bound's reference) always on the CPU. Ours runs on the JAX
devices: float32 with the materialised oracle at HIGHEST matmul precision (the engine's choice), bf16 with the
engine's choice (cuDNN on a GPU, splash on a TPU) and with the materialised oracle.

    python3 bench/parity_bench.py                                       # on the accelerator host
    .venv/bin/python bench/parity_bench.py --hidden 128 --layers 2 --heads 4 --kv-heads 2 --intermediate 256 \\
        --vocab 1000 --lengths 60,33,17                                 # the same checks, small, on a CPU
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from extract.batching import TokenizedSample, pack_window  # noqa: E402
from extract.engine import Engine  # noqa: E402

#: docs/MODEL.md, "Numerics and dtypes": float32 within 1e-5 of float64 relative to its largest value, and at most
#: 4 times transformers' own float32 error; bf16 per-token cosine similarity at least 0.999 against float32.
FLOAT32_RELATIVE, FLOAT32_TIMES_TRANSFORMERS, BF16_MIN_COSINE = 1e-5, 4.0, 0.999


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lengths", default="2048,1200,500,300", help="sample lengths (tokens)")
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32
    torch.backends.cudnn.allow_tf32 = False
    lengths = [int(n) for n in args.lengths.split(",")]
    hf = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(4096, max(lengths)), tie_word_embeddings=False, attn_implementation="eager",
        )  # fmt: skip
    ).eval()
    with torch.no_grad():  # transformers starts norms at one and biases at zero: draw them all
        for name, param in hf.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.05 * torch.randn_like(param))
    rng = np.random.default_rng(1)
    samples = [rng.integers(1, args.vocab, n).astype(np.int32) for n in lengths]

    def reference(model, device, dtype) -> list[list[np.ndarray]]:
        model = model.to(device=device, dtype=dtype)
        out = []
        with torch.inference_mode():
            for sample in samples:
                ids = torch.tensor(sample[None].astype(np.int64), device=device)
                states = model(ids, output_hidden_states=True).hidden_states
                out.append([h[0].double().cpu().numpy() for h in states])
        return out

    ref32 = reference(copy.deepcopy(hf), torch_device, torch.float32)
    ref64 = reference(copy.deepcopy(hf), "cpu", torch.float64)
    layers = list(range(1, args.layers + 1))
    max_len = max(lengths)
    device = jax.devices()[0]
    print(
        f"devices: {jax.device_count()} x {device.device_kind}; transformers on {torch_device}; shape hidden "
        f"{args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads; lengths {lengths}"
    )
    failures = 0
    with tempfile.TemporaryDirectory(prefix="parity-") as model_dir:
        hf.float().save_pretrained(model_dir)
        runs = [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "materialised")]
        for dtype, attention in runs:
            engine = Engine(
                model_dir, layers, batch_size=jax.device_count(), max_seq_len=max_len, compute_dtype=dtype,
                out_dtype="float32", attention=attention,
            )  # fmt: skip
            for packed in (False, True):
                ours = forward(engine, samples, max_len, packed)
                label = f"{dtype:8s} attention={engine.attention.kernel:12s} {'packed' if packed else 'padded':6s}"
                if dtype == "float32":
                    worst_rel = worst_ratio = 0.0
                    for mine, wide, narrow in zip(ours, ref64, ref32):
                        for layer in layers:
                            scale = np.abs(wide[layer]).max()
                            error = np.abs(mine[layer] - wide[layer]).max()
                            theirs = np.abs(narrow[layer] - wide[layer]).max()
                            worst_rel = max(worst_rel, error / scale)
                            worst_ratio = max(worst_ratio, error / max(theirs, 1e-30))
                    ok = worst_rel <= FLOAT32_RELATIVE and worst_ratio <= FLOAT32_TIMES_TRANSFORMERS
                    print(f"{label} max|ours-f64|/max|f64| {worst_rel:.2e} (bound {FLOAT32_RELATIVE:.0e}), "
                          f"{worst_ratio:.2f}x transformers' float32 error (bound {FLOAT32_TIMES_TRANSFORMERS:g}) "
                          f"{'ok' if ok else 'MISSED'}")  # fmt: skip
                else:
                    cosine = min(
                        float(per_token_cosine(mine[layer], narrow[layer]).min())
                        for mine, narrow in zip(ours, ref32) for layer in layers
                    )  # fmt: skip
                    ok = cosine >= BF16_MIN_COSINE
                    print(f"{label} min per-token cosine vs transformers float32 {cosine:.5f} "
                          f"(bound {BF16_MIN_COSINE}) {'ok' if ok else 'MISSED'}")  # fmt: skip
                failures += not ok
    return 1 if failures else 0


def forward(engine: Engine, samples: list[np.ndarray], length: int, packed: bool) -> list[dict[int, np.ndarray]]:
    """Each sample's hidden states, from right-padded rows (one sample a row) or packed rows."""
    out: dict[int, dict[int, np.ndarray]] = {}
    window = [TokenizedSample(p, p, s) for p, s in enumerate(samples)]
    rows = engine.batch_size
    if packed:
        batches = pack_window(window, rows, (length,), pad_id=0)
    else:
        batches = []
        for first in range(0, len(window), rows):
            group = window[first : first + rows]
            tokens = np.zeros((rows, length), np.int32)
            for r, sample in enumerate(group):
                tokens[r, : sample.n_tokens] = sample.token_ids
            batches.append((group, tokens))
    for batch in batches:
        if packed:
            hidden = engine.forward(batch.token_ids, batch.segment_ids, batch.positions)
            placed = zip(batch.samples, batch.placements)
        else:
            group, tokens = batch
            hidden = engine.forward(tokens)
            placed = ((sample, (r, 0)) for r, sample in enumerate(group))
        arrays = {layer: np.asarray(value, np.float64) for layer, value in hidden.items()}
        for sample, (row, column) in placed:
            out[sample.position] = {k: v[row, column : column + sample.n_tokens] for k, v in arrays.items()}
    return [out[p] for p in range(len(samples))]


def per_token_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


if __name__ == "__main__":
    sys.exit(main())
