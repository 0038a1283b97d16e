#!/usr/bin/env python3
"""What a job will cost, before it is launched (`gcs-spawner plan`, gcs_spawner/cli.py, under its old name):
`plan.py JOB --accelerator v5litepod-8 [--tasks tasks.jsonl]`, or `plan.py RUN`.

The planner lives in reporting/plan.py; see its docstring. Exit codes are the command's: 0 done, 1 failed, 2 usage,
65 bad input.
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("plan", argv)


if __name__ == "__main__":
    sys.exit(main())
