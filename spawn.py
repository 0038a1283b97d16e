#!/usr/bin/env python3
"""Worker entry point: drain a task queue. `python spawn.py QUEUE --consumer "python consume.py"`.

The queue package does the work; this file only plugs in the cloud hooks (self-deletion when the
queue is empty, the preemption watcher, the machine record), so that neither package imports the other.
"""

import os
import socket
import sys

from taskqueue.cli import run

_recorder = None  # this machine's fleet.machines.MachineRecorder, once machine_state made it


def self_delete() -> None:
    from fleet.selfdelete import delete_self

    if not delete_self() and _recorder is not None:
        # Still up (a group member that cannot delete itself stays up, fleet/selfdelete.py): the
        # record says so instead of `deleting`, so status shows why this machine is still billed.
        _recorder.set("failed", reason="self_delete_failed: this machine could not delete itself; check its service "
                                       "account's roles (docs/CLOUD.md, IAM), then run gcs-spawner keep RUN --once (or down RUN)")  # fmt: skip


def _on_maintenance(value: str) -> None:
    # The worker goes on until the machine actually stops (SIGTERM); the record shows the notice.
    if _recorder is not None:
        _recorder.base_fields["maintenance"] = value


def watch_preemption(on_preempted, required: bool):
    from fleet.metadata import on_gcp
    from fleet.preemption import PreemptionWatcher

    if not required and not on_gcp():
        return None
    watcher = PreemptionWatcher(on_preempted=on_preempted, on_notice=_on_maintenance)
    watcher.start()
    return watcher


def machine_state(store, required: bool):
    """The on_state hook: this machine's record, machines/<name>.json in the queue."""
    global _recorder
    from fleet.machines import DEFAULT_BEAT_S, MachineRecorder, machine_identity, maybe_on_gce
    from fleet.metadata import MetadataClient, on_gcp

    if maybe_on_gce() and on_gcp():
        identity = machine_identity(MetadataClient())
    elif required:
        identity = {"name": socket.gethostname().split(".")[0]}
    else:
        return None
    name = identity.pop("name")
    # SPAWN_MACHINE_BEAT_S: how often the record is refreshed (docs/PROTOCOL.md, "Machine records").
    beat_s = float(os.environ.get("SPAWN_MACHINE_BEAT_S", DEFAULT_BEAT_S))
    _recorder = MachineRecorder(store, name, beat_s=beat_s, **identity).start(carry_on=True)
    return _recorder.set


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], self_delete=self_delete, watch_preemption=watch_preemption, machine_state=machine_state))
