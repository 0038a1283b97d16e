"""Mirror this checkout to a bucket prefix, which the machines sync their code from at boot, with
the lock files (and, for firewalled fleets, the wheels) they install from.

    python tools/upload_code.py gs://B/code/NAME [--exclude 'data/*' ...] [--wheelhouse] [--python-mirror]

Skips .git, virtualenvs, caches and whatever git ignores; deletes objects whose files are gone.
Uses `gcloud storage rsync` when gcloud is installed, else google-cloud-storage with crc32c
comparison. Then compiles locks/<lock>.txt (cpu, cuda12, tpu) with `uv pip compile` for the fleet's
Python on the machines' glibc (--glibc, default 2.35: Ubuntu 22.04), checks that every pin has a
wheel those machines accept, and uploads them next to the code, with uv/uv: the static uv binary the
machines run (the version that runs here, or --uv-version). --wheelhouse also downloads every
locked wheel into wheelhouse/<lock>/, so that machines install with no index at all, and
--python-mirror the fleet's CPython into python-mirror/ (uv's mirror layout), so that they need no
download of the interpreter either.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from fleet import codesync, gapi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", help="gs://bucket/prefix to mirror to")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent, help="default: this checkout")
    parser.add_argument("--exclude", action="append", default=[], help="glob to skip as well (repeatable)")
    parser.add_argument("--no-gcloud", action="store_true", help="use google-cloud-storage even if gcloud is installed")
    parser.add_argument("--python", default="3.11", help="the fleet's CPython version (the spec's python; default 3.11)")
    parser.add_argument("--lock", action="append", choices=sorted(codesync.LOCKS), help="locks to make (default: all)")
    parser.add_argument("--extras", default="extract", help="package extras the machines install (default: extract)")
    parser.add_argument("--no-locks", action="store_true", help="upload the code only (machines then install unpinned)")
    parser.add_argument("--wheelhouse", action="store_true", help="also upload every locked wheel (firewalled fleets)")
    parser.add_argument("--glibc", default="{}.{}".format(*codesync.MACHINE_GLIBC),
                        help="the machines' glibc (default %(default)s, Ubuntu 22.04's); locks take wheels up to it")
    parser.add_argument("--uv-version", help="the uv the machines run (default: the version of this uv)")
    parser.add_argument("--python-mirror", action="store_true",
                        help="also upload the fleet's CPython archive as that uv downloads it (firewalled fleets)")
    args = parser.parse_args()
    glibc = tuple(int(part) for part in args.glibc.split(".") if part.isdigit())
    if len(glibc) != 2 or args.glibc.count(".") != 1:
        parser.error(f"--glibc {args.glibc!r}: expected a version such as 2.35")
    gapi.setup_logging()
    use_gcloud = False if args.no_gcloud else None
    extras = [e for e in args.extras.split(",") if e]
    try:
        codesync.sync_code(args.source, args.dest, args.exclude, use_gcloud=use_gcloud)
        if args.no_locks:
            return
        with tempfile.TemporaryDirectory(prefix="upload-code-") as staging:
            codesync.build_environment(
                args.source, Path(staging), args.python, extras=extras,
                locks=args.lock or tuple(codesync.LOCKS), wheelhouse=args.wheelhouse,
                glibc=glibc, uv=args.uv_version or codesync.uv_version(), python_mirror=args.python_mirror,
            )
            codesync.upload_generated(Path(staging), args.dest, use_gcloud=use_gcloud)
    except codesync.CodeSyncError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
