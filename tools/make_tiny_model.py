#!/usr/bin/env python3
"""Write a tiny random Qwen checkpoint (and optionally FineWeb-Edu-like parquet files) for demos and tests."""

import argparse
import sys

from extract.tiny import write_fineweb_like_parquet, write_tiny_qwen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", help="directory to write config.json, model.safetensors and the tokenizer into")
    parser.add_argument("--model-type", choices=("qwen2", "qwen3"), default="qwen3")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--tie", action="store_true", help="tie the output head to the embeddings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", help="also write FineWeb-Edu-like parquet files here")
    parser.add_argument("--files", type=int, default=2, help="parquet files to write (with --data-dir)")
    parser.add_argument("--rows", type=int, default=100, help="rows per parquet file (with --data-dir)")
    args = parser.parse_args(argv)
    write_tiny_qwen(
        args.model_dir, model_type=args.model_type, hidden=args.hidden, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, tie=args.tie, seed=args.seed,
    )  # fmt: skip
    print(f"model={args.model_dir} model_type={args.model_type}")
    if args.data_dir:
        paths = write_fineweb_like_parquet(args.data_dir, args.files, args.rows, seed=args.seed)
        print(f"data={args.data_dir} files={len(paths)} rows={args.files * args.rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
