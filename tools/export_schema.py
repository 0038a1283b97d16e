#!/usr/bin/env python3
"""Write the JSON Schemas of the job, the machine specs and the run file into docs/schema/, from the models that
validate them.

`export_schema.py` rewrites the files; `export_schema.py --check` only says which ones differ from the models
(exit 1). Editors pick the files up as docs/schema/README.md shows.
"""

import argparse
import sys
from pathlib import Path

from extract.job import Job
from fleet.specs import TpuSpec, VmSpec
from gcs_spawner.runfile import RunFile
from schemas import json_schema

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "docs" / "schema"
#: file name -> the model it describes: the job file, the two kinds of templates/*.yaml, and the run file (which
#: refers to the other three for its inline job and spec).
MODELS = {"job.json": Job, "vm-spec.json": VmSpec, "tpu-spec.json": TpuSpec, "run.json": RunFile}


def rendered() -> dict[str, str]:
    """Each schema file's text as the models make it now."""
    return {name: json_schema(model) for name, model in MODELS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from its model")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR, help="where the files go (default: docs/schema)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = args.dir / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
            print(f"event=schema_written file={path}")
    if args.check and stale:
        stale_list = ", ".join(stale)
        print(f"export_schema.py: {stale_list} differ from the models; run tools/export_schema.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
