#!/usr/bin/env python3
"""Mirror this checkout to a bucket prefix, which the machines sync their code from at boot, with the lock files
(and, for firewalled fleets, the wheels) they install from: `gcs-spawner upload-code` (gcs_spawner/cli.py) under
its old name.

    python tools/upload_code.py gs://B/code/NAME [--exclude 'data/*' ...] [--wheelhouse] [--python-mirror]

Skips .git, virtualenvs, caches and whatever git ignores; deletes objects whose files are gone. Uses `gcloud
storage rsync` when gcloud is installed, else google-cloud-storage with crc32c comparison. Then compiles
locks/<lock>.txt (cpu, cuda12, tpu) with `uv pip compile` for the fleet's Python on the machines' glibc (--glibc,
default 2.35: Ubuntu 22.04), checks that every pin has a wheel those machines accept, and uploads them next to the
code, with uv/uv: the static uv binary the machines run. --wheelhouse also downloads every locked wheel into
wheelhouse/<lock>/, and --python-mirror the fleet's CPython into python-mirror/ (fleet/codesync.py, fleet/environment.py).
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("upload-code", argv)


if __name__ == "__main__":
    sys.exit(main())
