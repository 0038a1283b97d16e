"""Mirror this checkout to a bucket prefix, which the machines sync their code from at boot.

    python tools/upload_code.py gs://B/code/NAME [--exclude 'data/*' ...]

Skips .git, virtualenvs and caches; deletes objects whose files are gone. Uses `gcloud storage
rsync` when gcloud is installed, else google-cloud-storage with crc32c comparison.
"""

import argparse
import sys
from pathlib import Path

from fleet import codesync, gapi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", help="gs://bucket/prefix to mirror to")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent, help="default: this checkout")
    parser.add_argument("--exclude", action="append", default=[], help="glob to skip as well (repeatable)")
    parser.add_argument("--no-gcloud", action="store_true", help="use google-cloud-storage even if gcloud is installed")
    args = parser.parse_args()
    gapi.setup_logging()
    try:
        codesync.sync_code(args.source, args.dest, args.exclude, use_gcloud=False if args.no_gcloud else None)
    except codesync.CodeSyncError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
