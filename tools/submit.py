#!/usr/bin/env python3
"""Write job.json and the task manifests into a queue, create-only: `submit.py QUEUE --job J --tasks T.jsonl`.

A submit that fails (a task that exists with another manifest, a store error, Ctrl-C, SIGTERM)
finishes its batch before it exits, so no worker or status waits for it. `--finish-batch ID`
finishes a batch whose submit died with its machine (`tools/status.py` names it).
"""

import argparse
import pathlib
import signal
import sys

from objectstore import StoreError, open_store
from taskqueue.submit import SubmitError, finish_batch, read_tasks, submit


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # so that SIGTERM, like Ctrl-C, finishes the batch first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("queue", help="gs://bucket/prefix or a local directory")
    p.add_argument("--job", type=pathlib.Path, help="job.json to store at the queue root")
    p.add_argument("--tasks", type=pathlib.Path, help="JSON lines, one task manifest with an 'id' each")
    p.add_argument("--finish-batch", metavar="ID",
                   help="finish the running batch ID whose submit will never run again (status names it)")
    args = p.parse_args()
    if (args.tasks is None) == (args.finish_batch is None):
        p.error("give --tasks to submit, or --finish-batch ID to finish a dead submit's batch")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        store = open_store(args.queue)
        if args.finish_batch:
            print(finish_batch(store, args.finish_batch))
            return 0
        job = args.job.read_bytes() if args.job else None
        report = submit(store, job, read_tasks(args.tasks))
    except (SubmitError, OSError) as exc:
        print(f"submit.py: {exc}", *getattr(exc, "__notes__", ()), sep="\n", file=sys.stderr)
        return 2
    except StoreError as exc:
        print(f"submit.py: the store failed: {exc}", *getattr(exc, "__notes__", ()), sep="\n", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print("submit.py: interrupted", *getattr(exc, "__notes__", ()), sep="\n", file=sys.stderr)
        return 130
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
