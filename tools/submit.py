#!/usr/bin/env python3
"""Write job.json and the task manifests into a queue, create-only: `submit.py QUEUE --job J --tasks T.jsonl`."""

import argparse
import pathlib
import sys

from objectstore import open_store
from taskqueue.submit import SubmitError, read_tasks, submit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("queue", help="gs://bucket/prefix or a local directory")
    p.add_argument("--job", type=pathlib.Path, help="job.json to store at the queue root")
    p.add_argument("--tasks", type=pathlib.Path, required=True, help="JSON lines, one task manifest with an 'id' each")
    args = p.parse_args()
    try:
        job = args.job.read_bytes() if args.job else None
        report = submit(open_store(args.queue), job, read_tasks(args.tasks))
    except (SubmitError, OSError) as exc:
        print(f"submit.py: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
