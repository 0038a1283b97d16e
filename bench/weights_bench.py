"""Weight loading from gs://: parallel ranged reads into device placement against a single-stream download.

A random Qwen2-shaped checkpoint (bf16, default ~0.75 GB) is uploaded to the test GCS server (`python -m
tests.fakegcs`, its own process). Measured side by side in one run, on the same checkpoint:

- single stream: `fetch_from_store` as it downloads a file, one sequential reader per file (what loading a gs://
  model did before: download everything, then load from the local copy);
- parallel: `Checkpoint.from_store` + `load_state`, the Engine's gs:// path: ranged reads of every tensor, many in
  flight, converted and placed on the devices as they arrive.

Both with no added latency and with `--latency` seconds added per request (a server that is not CPU-bound, as
GCS is not: its per-request latency is what one stream waits on).

    .venv/bin/python bench/weights_bench.py [--layers 24] [--latency 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import objectstore  # noqa: E402
from bench.host_bench import fake_gcs_server  # noqa: E402
from extract.config import ModelConfig  # noqa: E402
from extract.engine import Engine  # noqa: E402
from extract.weights import LOAD_WORKERS, Checkpoint, fetch_from_store, load_state, upload_model_dir  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def write_checkpoint(directory: pathlib.Path, layers: int, hidden: int, intermediate: int, vocab: int) -> ModelConfig:
    """A random bf16 Qwen2-shaped checkpoint written with the repo's own safetensors encoder."""
    from extract.writer import encode_safetensors

    config = {
        "model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": hidden // 64, "num_key_value_heads": 2,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    kv = 2 * 64

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(BF16)

    tensors = {"model.embed_tokens.weight": dense(vocab, hidden), "model.norm.weight": np.ones(hidden, BF16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden, BF16),
            p + "post_attention_layernorm.weight": np.ones(hidden, BF16),
            p + "self_attn.q_proj.weight": dense(hidden, hidden), p + "self_attn.q_proj.bias": dense(hidden),
            p + "self_attn.k_proj.weight": dense(kv, hidden), p + "self_attn.k_proj.bias": dense(kv),
            p + "self_attn.v_proj.weight": dense(kv, hidden), p + "self_attn.v_proj.bias": dense(kv),
            p + "self_attn.o_proj.weight": dense(hidden, hidden),
            p + "mlp.gate_proj.weight": dense(intermediate, hidden),
            p + "mlp.up_proj.weight": dense(intermediate, hidden),
            p + "mlp.down_proj.weight": dense(hidden, intermediate),
        }  # fmt: skip
    (directory / "model.safetensors").write_bytes(encode_safetensors(tensors, {"format": "pt"}))
    return ModelConfig.from_dict(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added per request in the second round")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="weights-bench-") as scratch, fake_gcs_server() as url:
        os.environ["STORAGE_EMULATOR_HOST"] = url
        from tests.fakegcs.server import FakeGCSAdmin

        root = pathlib.Path(scratch)
        config = write_checkpoint(root / "model", args.layers, args.hidden, args.intermediate, args.vocab)
        size = (root / "model" / "model.safetensors").stat().st_size
        upload_model_dir(root / "model", "gs://bench/model")
        print(f"checkpoint: qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab} bf16, "
              f"{size / 1e9:.2f} GB; cores={os.cpu_count()} load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        print(f"{'added latency':>14s} {'download 1 stream':>18s} {'ranged reads':>13s} {'ratio':>6s}   "
              f"{'old load (download+local)':>26s} {'new load (in place)':>20s} {'ratio':>6s}   GB/s")  # fmt: skip
        for latency in (0.0, args.latency):
            FakeGCSAdmin(url).faults.add_latency(latency)
            cache = root / f"cache-{latency}"
            started = time.perf_counter()
            fetch_from_store("gs://bench/model", cache)
            download = time.perf_counter() - started

            checkpoint = Checkpoint.from_store("gs://bench/model")
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=LOAD_WORKERS) as pool:
                list(pool.map(checkpoint.read, list(checkpoint.tensors)))
            checkpoint.close()
            ranged = time.perf_counter() - started

            def place(source: Checkpoint) -> float:
                engine = Engine.__new__(Engine)  # only the placement: mesh, shardings, abstract state
                engine._configure(1, 64, "bfloat16", "bfloat16", "auto", None)
                engine.config = config
                engine._place([config.num_hidden_layers], None, None, None)
                started = time.perf_counter()
                load_state(
                    source, engine._abstract_state, engine.mesh, engine._rules, engine._compute_dtype, config=config
                )
                return time.perf_counter() - started

            old = download + place(Checkpoint(cache))
            new = place(Checkpoint.from_store("gs://bench/model"))
            # The embedding is tied and every layer is loaded, so every byte of the file is read by both.
            print(
                f"{latency * 1000:11.0f} ms {size / download / 1e9:18.3f} {size / ranged / 1e9:13.3f} "
                f"{download / ranged:5.2f}x   {size / old / 1e9:26.3f} {size / new / 1e9:20.3f} {old / new:5.2f}x"
            )
            FakeGCSAdmin(url).faults.reset()


if __name__ == "__main__":
    main()
