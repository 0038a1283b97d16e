#!/usr/bin/env python3
"""Export a job's activations to another tool's layout.

    python tools/export.py gs://B/jobs/J --to saelens out/saelens-L16 --layer 16 --context-size 1024
    python tools/export.py gs://B/jobs/J --to saelens out/saelens-mlp3 --site mlp_out --layer 3

`--to saelens`: SAELens's cached-activations directory (a Hugging Face `datasets` directory with one column named
after the TransformerLens hook, `blocks.{L-1}.hook_resid_post` for our hidden-state index L, `blocks.{l}.hook_mlp_out`
for `--site mlp_out --layer l`, ..., and `token_ids`, rows of exactly `--context-size` tokens);
`ActivationsStore(cached_activations_path=...)` reads it. See docs/TRAINING.md and docs/EXTRACTION.md ("Hook sites").
"""

import argparse
import json
import sys

from activations import ActivationsError
from activations.format import SITES
from activations.saelens import export_cached_activations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a queue (gs://bucket/prefix or a directory), a done marker, or a prefix of shards")
    parser.add_argument("--to", required=True, choices=["saelens"], help="the layout to write")
    parser.add_argument("directory", help="where to write it (a local directory)")
    parser.add_argument("--layer", type=int, required=True,
                        help="hidden-state index, as in the job's layers; with --site, a decoder layer from 0")
    parser.add_argument("--site", default="hidden", choices=("hidden", *SITES),
                        help="a hook site the job kept (its sites), or hidden (default) for hidden states")
    parser.add_argument("--context-size", type=int, default=128, help="tokens per row")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = parser.parse_args()
    try:
        summary = export_cached_activations(args.source, args.directory, layer=args.layer, site=args.site,
                                            context_size=args.context_size, dtype=args.dtype)  # fmt: skip
    except ActivationsError as err:
        sys.exit(f"error: {err}")
    print(json.dumps({"directory": args.directory, **summary}))


if __name__ == "__main__":
    main()
