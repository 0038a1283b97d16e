#!/usr/bin/env python3
"""Plan the tasks of an extraction job (`gcs-spawner tasks`, gcs_spawner/cli.py, under its old name):
`make_tasks.py JOB --rows-per-task N -o tasks.jsonl`.

Reads only metadata: parquet row counts come from each file's footer (ranged reads on gs:// and on the Hub); JSON
Lines files are read through once to count their lines. Writes one task manifest per line (docs/EXTRACTION.md).
`--rows-per-task auto --accelerator TYPE` sizes tasks to last about --target-minutes on that accelerator, as
tools/plan.py recommends. The logic is gcs_spawner/tasks.py.
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("tasks", argv)


if __name__ == "__main__":
    sys.exit(main())
