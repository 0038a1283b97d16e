#!/usr/bin/env python3
"""Would fp8 storage do? fp8 e4m3 with a scale per token, measured on a Qwen2.5-7B-shaped model's activations.

    .venv/bin/python bench/fp8_storage.py --work /tmp/fp8 [--rows 400] [--steps 400] [--massive 10000]

What it measures (issue 31's bar for a compact dtype):
1. Reconstruction error of fp8 e4m3 with a per-token scale (absmax / 448), per layer: relative squared error
   overall, on ordinary tokens, on the tokens that carry massive activations, and on the ordinary dimensions of
   those tokens; beside a per-tensor scale (one scale for the whole layer), to show what the per-token scale buys.
2. SAEs trained with SAELens through the repository's path (ActivationLoader(normalize="mean_norm") ->
   activations.saelens.data_provider -> SAETrainer, as tests/activations/test_saelens.py does), once on the stored
   bf16 activations and once on their fp8 round trip, same tokens, same seeds; explained variance of each on the
   bf16 activations. The bar: the fp8 SAE within 0.005 of the bf16 one.

The model. No real Qwen2.5-7B weights can be had here (no Hub), so: a random-weight checkpoint with Qwen2.5-7B's
residual shape (hidden 3584, 28 query / 4 KV heads of 128, MLP 18944) and 2 decoder layers, run by our own engine
(extract.consumer.run, fp32 compute, bf16 output), with the two features of a trained Qwen residual stream that
matter to a per-token 8-bit format written into its embedding, so every layer's residual stream carries them:
- massive activations: on the delimiter tokens ("." "," and newline), two fixed dimensions hold +M and -0.6 M
  (--massive, default 10,000 against ordinary values of about 1: about four times the 2,622 that Sun et al. 2024,
  "Massive Activations in Large Language Models", report for LLaMA2-7B, and inside the 10^2..10^4 range the
  2026 survey of open models (arXiv 2605.15572) gives for dense Qwen checkpoints);
- outlier features: 6 dimensions 20 times larger than the rest on every token (Dettmers et al. 2022,
  LLM.int8(), report about 20x systematic outlier dimensions from 6.7B parameters up).
Per-token quantisation sees one token's vector at a time, so what matters is the spread within a token: the
massive tokens are the hard case (their scale is set by M, squeezing the ordinary dimensions towards fp8's
subnormals), and they are in the data.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from activations.format import FP8, FP8_MAX, dequantize, quantize_per_token  # noqa: E402

MASSIVE_DIMS = (1000, 2000)
OUTLIER_DIMS = (7, 311, 1500, 2222, 2900, 3401)
DELIMITERS = (".", ",", "\n")


def build_model(work: pathlib.Path, massive: float) -> pathlib.Path:
    """A Qwen2.5-7B-shaped checkpoint (2 layers) with massive activations and outlier features in its embedding."""
    from safetensors.numpy import load_file, save_file

    from extract.tiny import write_tiny_qwen

    directory = work / "model"
    if (directory / "planted.json").exists():
        return directory
    write_tiny_qwen(directory, model_type="qwen2", hidden=3584, layers=2, heads=28, kv_heads=4, vocab=512,
                    intermediate=18944, seed=0)  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    delimiter_ids = sorted({i for text in DELIMITERS for i in tokenizer(text, add_special_tokens=False)["input_ids"]})
    weights = load_file(str(directory / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    embedding[:, list(OUTLIER_DIMS)] *= 20.0
    embedding[np.ix_(delimiter_ids, [MASSIVE_DIMS[0]])] = massive
    embedding[np.ix_(delimiter_ids, [MASSIVE_DIMS[1]])] = -0.6 * massive
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "planted.json").write_text(json.dumps({"massive": massive, "delimiter_ids": delimiter_ids}))
    return directory


def extract(work: pathlib.Path, model: pathlib.Path, rows: int) -> pathlib.Path:
    """bf16 shards of layers 1 and 2 for `rows` FineWeb-like rows, written by the real consumer."""
    from extract.consumer import RunInputs, run
    from extract.job import Job, Task
    from extract.tiny import write_fineweb_like_parquet

    out = work / "bf16"
    if (out / "done.json").exists():
        return out
    [data] = write_fineweb_like_parquet(work / "data", n_files=1, rows_per_file=rows, seed=11)
    job = Job.from_dict({"model": str(model), "data_files": [str(data)], "layers": [1, 2], "max_seq_len": 256,
                         "batch_size": 4, "shard_size": 64, "compute_dtype": "fp32"})  # fmt: skip
    task = Task.from_dict({"id": "t0", "files": [{"path": str(data), "base": 0, "start": 0, "end": rows}]})
    started = time.monotonic()
    result = run(RunInputs(job=job, task=task, output_url=str(out)))
    stats = result.stats or {}
    print(f"extracted {stats.get('tokens')} tokens in {time.monotonic() - started:.0f} s", flush=True)
    (out / "done.json").write_text(json.dumps({"task": "t0", "outputs": result.records}))
    return out


def fp8_per_tensor(rows: np.ndarray) -> np.ndarray:
    scale = np.float32(np.abs(rows).max() / FP8_MAX)
    return (rows / scale).astype(FP8).astype(np.float32) * scale


def relative_error(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(((approx - exact) ** 2).sum() / max((exact**2).sum(), 1e-30))


def write_fp8_shards(source: pathlib.Path, target: pathlib.Path) -> None:
    """The bf16 shards in the fp8 format the writer writes for `dtype: fp8` (e4m3 and a scale per token, the
    statistics of the product), so that the SAE reads them through the loader's fp8 path."""
    from activations.format import LayerStats, encode_safetensors, layer_key, scale_key, stats_keys
    from activations.reader import open_activations

    target.mkdir(parents=True, exist_ok=True)
    for shard in open_activations(str(source / "done.json")).iter_shards():
        tensors = {}
        for layer in (1, 2):
            values, scale = quantize_per_token(shard.layer(layer))
            tensors.update(LayerStats.of(values, scale).tensors(layer))
            tensors[layer_key(layer)], tensors[scale_key(layer)] = values, scale
        tensors.update({name: shard.tensors[name] for name in ("token_ids", "sample_ids", "offsets")})
        order = [k for layer in (1, 2) for k in stats_keys(layer)] + [layer_key(1), layer_key(2)]
        order += [scale_key(1), scale_key(2), "token_ids", "sample_ids", "offsets"]
        metadata = {k: (json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in shard.metadata.items()}
        metadata["dtype"] = "fp8"
        name = pathlib.Path(shard.ref.url).name
        (target / name).write_bytes(encode_safetensors({k: tensors[k] for k in order}, metadata))


def reconstruction_table(source: pathlib.Path) -> None:
    from activations.reader import open_activations

    acts = open_activations(str(source / "done.json"))
    planted = json.loads((source.parent / "model" / "planted.json").read_text())
    massive_token = np.isin(acts.token_ids(), planted["delimiter_ids"])
    ordinary_dims = np.setdiff1d(np.arange(acts.hidden_size), MASSIVE_DIMS)
    print(f"\n{acts.num_tokens} tokens, {int(massive_token.sum())} of them delimiters carrying massive activations")
    print("relative squared error ||q(x) - x||^2 / ||x||^2 of fp8 e4m3 (per-token scale unless said)")
    print("(layer 1: block 1's output, the residual stream; layer 2: the final norm's output of this 2-block model)")
    print(f"{'layer':>5} {'max|x|':>9} {'median rms':>10} {'all':>10} {'ordinary':>10} {'massive tok':>11} "
          f"{'their rest':>10} {'per-tensor':>10} {'p-t ordinary':>12}")  # fmt: skip
    for layer in (1, 2):
        x = np.asarray(acts.layer(layer), np.float32)
        values, scale = quantize_per_token(x)
        q = dequantize(values, scale)
        t = fp8_per_tensor(x)
        rms = np.sqrt((x**2).mean(axis=1))
        rest = np.ix_(massive_token, ordinary_dims)
        print(f"{layer:>5} {np.abs(x).max():>9.0f} {np.median(rms):>10.3f} {relative_error(q, x):>10.2e} "
              f"{relative_error(q[~massive_token], x[~massive_token]):>10.2e} "
              f"{relative_error(q[massive_token], x[massive_token]):>11.2e} {relative_error(q[rest], x[rest]):>10.2e} "
              f"{relative_error(t, x):>10.2e} {relative_error(t[~massive_token], x[~massive_token]):>12.2e}")  # fmt: skip


def train_sae(source: str, layer: int, steps: int, seed: int, d_sae: int):
    import torch
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig

    from activations.loader import ActivationLoader
    from activations.saelens import data_provider

    torch.manual_seed(seed)
    loader = ActivationLoader(source, layers=layer, batch_size=256, shuffle_tokens=4096, epochs=None, output="torch",
                              normalize="mean_norm", seed=seed)  # fmt: skip
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=loader.hidden_size, d_sae=d_sae, l1_coefficient=0.5,
                                                        normalize_activations="none"))  # fmt: skip
    cfg = SAETrainerConfig(total_training_samples=steps * 256, train_batch_size_samples=256, lr=1e-3, lr_end=1e-3,
                           device="cpu", logger=LoggingConfig(log_to_wandb=False))  # fmt: skip
    SAETrainer(cfg=cfg, sae=sae, data_provider=data_provider(loader)).fit()
    loader.close()
    return sae


def massive_sweep(source: pathlib.Path, layer: int = 1) -> None:
    """The same tokens with their massive values scaled up: where the per-token scale stops coping. A massive
    token's scale is M / 448, so its ordinary values (about 1) land at 448 / M: below e4m3's smallest normal, 2^-6,
    once M passes ~3e4, where subnormals (spaced 2^-9) keep fewer bits."""
    from activations.reader import open_activations

    acts = open_activations(str(source / "done.json"))
    planted = json.loads((source.parent / "model" / "planted.json").read_text())
    massive_token = np.isin(acts.token_ids(), planted["delimiter_ids"])
    ordinary_dims = np.setdiff1d(np.arange(acts.hidden_size), MASSIVE_DIMS)
    x = np.asarray(acts.layer(layer), np.float32)[massive_token]
    print(f"\nlayer {layer}, the {len(x)} massive tokens with their massive dimensions multiplied by k: relative squared "
          "error of their ordinary dimensions")  # fmt: skip
    for k in (0.1, 1, 10, 100):
        scaled = x.copy()
        scaled[:, list(MASSIVE_DIMS)] *= k
        q = dequantize(*quantize_per_token(scaled))
        rest = (slice(None), ordinary_dims)
        print(f"  M = {planted['massive'] * k:>9.0f}: {relative_error(q[rest], scaled[rest]):.2e}")


def explained_variance(sae, x) -> float:
    import torch

    with torch.no_grad():
        reconstruction = sae(x)
    return float(1 - ((x - reconstruction) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())


def sae_comparison(
    work: pathlib.Path, steps: int, d_sae: int, seeds: tuple[int, ...], dtypes: tuple[str, ...] = ("bf16", "fp8"),
    layer: int = 1,
) -> None:
    """SAEs on layer 1, block 1's output: the residual stream with its massive dimensions (layer 2 of this 2-block
    model is the final norm's output, whose RMS normalisation removes them)."""
    import torch

    from activations.loader import ActivationLoader
    from activations.reader import open_activations

    bf16, fp8 = work / "bf16", work / "fp8"
    write_fp8_shards(bf16, fp8)
    acts = open_activations(str(bf16 / "done.json"))
    planted = json.loads((work / "model" / "planted.json").read_text())
    ordinary = ~np.isin(acts.token_ids(), planted["delimiter_ids"])
    scale_of = {}  # the loader's mean_norm scaling of each source: sqrt(d) / E||x||, from the stored statistics
    for name, source in (("bf16", str(bf16 / "done.json")), ("fp8", str(fp8))):
        with ActivationLoader(source, layers=layer, batch_size=8, shuffle=False) as loader:
            scale_of[name] = math.sqrt(loader.hidden_size) / loader.stats()[layer].mean_norm
    truth = np.asarray(acts.layer(layer), np.float32)
    rows = {"bf16": truth, "fp8": None}
    rows["fp8"] = dequantize(*quantize_per_token(truth))
    results = {}
    for seed in seeds:
        for name, source in (("bf16", str(bf16 / "done.json")), ("fp8", str(fp8))):
            if name not in dtypes:
                continue
            started = time.monotonic()
            sae = train_sae(source, layer, steps, seed, d_sae)
            own = torch.from_numpy(rows[name] * scale_of[name])
            true = torch.from_numpy(truth * scale_of[name])
            results[name, seed] = {
                "ev_on_bf16": explained_variance(sae, true),
                "ev_on_bf16_ordinary": explained_variance(sae, true[torch.from_numpy(ordinary)]),
                "ev_on_own_input": explained_variance(sae, own),
                "seconds": round(time.monotonic() - started, 1),
            }
            print(f"SAE on {name} (seed {seed}): {json.dumps(results[name, seed])}", flush=True)
    print(f"\nSAE, layer {layer}, d_in {truth.shape[1]}, d_sae {d_sae}, {steps} steps x 256 tokens, mean_norm; "
          "explained variance on the bf16 activations")  # fmt: skip
    if set(dtypes) != {"bf16", "fp8"}:
        return  # one side only (the two sides can run as two processes): compare their printed lines
    for seed in seeds:
        a, b = results["bf16", seed], results["fp8", seed]
        print(f"  seed {seed}: bf16 {a['ev_on_bf16']:.4f}  fp8 {b['ev_on_bf16']:.4f}  difference "
              f"{a['ev_on_bf16'] - b['ev_on_bf16']:+.4f}   (ordinary tokens: {a['ev_on_bf16_ordinary']:.4f} vs "
              f"{b['ev_on_bf16_ordinary']:.4f}, {a['ev_on_bf16_ordinary'] - b['ev_on_bf16_ordinary']:+.4f})")  # fmt: skip
    if len(seeds) > 1:
        noise = results["bf16", seeds[0]]["ev_on_bf16"] - results["bf16", seeds[1]]["ev_on_bf16"]
        print(f"  run-to-run (bf16 seed {seeds[0]} - seed {seeds[1]}): {noise:+.4f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="scratch directory (the model and shards are kept for reruns)")
    parser.add_argument("--rows", type=int, default=400, help="FineWeb-like rows to extract (default 400)")
    parser.add_argument("--massive", type=float, default=10000.0, help="massive activation value (default 10000)")
    parser.add_argument("--steps", type=int, default=400, help="SAE training steps of 256 tokens (default 400)")
    parser.add_argument("--d-sae", type=int, default=4096, help="SAE latents (default 4096)")
    parser.add_argument("--seeds", default="0,1", help="SAE seeds, each trained on bf16 and on fp8 (default 0,1)")
    parser.add_argument("--dtypes", default="bf16,fp8", help="which SAEs to train (default bf16,fp8)")
    parser.add_argument("--skip-sae", action="store_true", help="only the reconstruction table")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work, args.massive)
    bf16 = extract(work, model, args.rows)
    reconstruction_table(bf16)
    massive_sweep(bf16)
    if not args.skip_sae:
        sae_comparison(work, args.steps, args.d_sae, tuple(int(s) for s in args.seeds.split(",")),
                       tuple(args.dtypes.split(",")))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
