#!/usr/bin/env python3
"""Progress and cost of a queue from its listings: `gcs-spawner status` (gcs_spawner/cli.py) under its old name.

    python tools/status.py QUEUE|RUN [--json] [--html FILE] [--publish] [--watch [SECONDS]] [--machines] [--estimate]

The view is reporting/view.py's (`job_view`, `render_text`, re-exported here for the tests and benchmarks that
import them from this file); `gcs-spawner status --help` lists the flags.
"""

import sys

from gcs_spawner.cli import tool
from reporting.view import PAGE_OBJECT, job_view, render_text  # noqa: F401 (re-exported)


def main(argv: list[str] | None = None) -> int:
    return tool("status", argv)


if __name__ == "__main__":
    sys.exit(main())
