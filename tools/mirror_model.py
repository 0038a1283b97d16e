"""Copy a model checkpoint into a bucket, so that a fleet of a thousand VMs reads GCS instead of the Hugging Face Hub.

    python tools/mirror_model.py Qwen/Qwen2.5-7B gs://B/models/qwen2.5-7b [--revision R]
    python tools/mirror_model.py /path/to/local/model gs://B/models/mine

SOURCE is a hub id (downloaded with config, tokenizer and safetensors files only) or a local model directory.
DEST is a gs:// prefix or a local directory. Jobs then name DEST as their model.
"""

import argparse
import logging
import pathlib
import sys

from extract.errors import BadInput, ExtractError
from extract.weights import mirror_hub_snapshot, upload_model_dir
from objectstore import StoreError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="hub id (org/name) or a local model directory")
    parser.add_argument("dest", help="gs://bucket/prefix or a local directory")
    parser.add_argument("--revision", help="hub branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if pathlib.Path(args.source).is_dir():
            if args.revision:
                parser.error("--revision applies to hub ids, not to a local directory")
            names = upload_model_dir(args.source, args.dest)
        else:
            names = mirror_hub_snapshot(args.source, args.dest, revision=args.revision)
    except (ExtractError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 65 if isinstance(err, BadInput) else 1
    print(f"mirrored {len(names)} files to {args.dest}: {' '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
