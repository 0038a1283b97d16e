#!/usr/bin/env python3
"""Export a job's activations to another tool's layout (`gcs-spawner export`, gcs_spawner/cli.py, under its old
name).

    python tools/export.py gs://B/jobs/J out/saelens-L16 --layer 16 --context-size 1024
    python tools/export.py gs://B/jobs/J out/saelens-mlp3 --site mlp_out --layer 3

`--format saelens` (the default): SAELens's cached-activations directory (a Hugging Face `datasets` directory with
one column named after the TransformerLens hook, `blocks.{L-1}.hook_resid_post` for our hidden-state index L,
`blocks.{l}.hook_mlp_out` for `--site mlp_out --layer l`, ..., and `token_ids`, rows of exactly `--context-size`
tokens); `ActivationsStore(cached_activations_path=...)` reads it. See docs/TRAINING.md and docs/EXTRACTION.md
("Hook sites").
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("export", argv)


if __name__ == "__main__":
    sys.exit(main())
