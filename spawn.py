#!/usr/bin/env python3
"""Worker entry point: drain a task queue. `python spawn.py QUEUE --consumer "python consume.py"`.

The queue package does the work; this file only plugs in the cloud hooks (self-deletion when the
queue is empty, the preemption watcher), so that neither package imports the other.
"""

import sys

from taskqueue.cli import run


def self_delete() -> None:
    from fleet.selfdelete import delete_self

    delete_self()


def watch_preemption(on_preempted, required: bool):
    from fleet.metadata import on_gcp
    from fleet.preemption import PreemptionWatcher

    if not required and not on_gcp():
        return None
    watcher = PreemptionWatcher(on_preempted=on_preempted)
    watcher.start()
    return watcher


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], self_delete=self_delete, watch_preemption=watch_preemption))
