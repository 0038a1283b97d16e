#!/usr/bin/env python3
"""Write a job's index (`gcs-spawner merge`, gcs_spawner/cli.py, under its old name): every shard its done
markers list, with totals.

    python tools/merge.py gs://B/jobs/J             # writes gs://B/jobs/J/index.json
    python tools/merge.py /tmp/queue -o -           # prints it

The totals line counts tasks, shards, samples, stored tokens (`tokens`) and bytes, plus the records' counters: a
sampled job's (token_sample, drop_first) `processed_tokens` beside its `stored_tokens`, and `skipped_rows`.
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("merge", argv)


if __name__ == "__main__":
    sys.exit(main())
