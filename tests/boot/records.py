"""Machine records against how each machine of a rehearsal ended (issue 48): the record a machine
left in `machines/<name>.json` (fleet/machines.py) as it stopped, for every boot, must say how it ended.

A rehearsal (the VM one in tests/boot/fleet.py; a TPU one can share this) reads each machine's record
the moment that boot stops, before a recreated machine of the same name overwrites it, and passes
`Ending`s here; `problems` returns one line per record that does not match (none: all held).

What each ending must leave (docs/PROTOCOL.md, "Machine records"; taskqueue/cli.py writes the worker's
final records, startup/startup.sh a failed boot's):

| how it ended | state | reason |
|---|---|---|
| self-deleted (`--on-empty delete`, nothing left to run) | `deleting` | `queue drained` or `queue idle`, with no dead-letter note unless expected |
| preempted (the spot notice, then the stop) | `exited` | `preempted` |
| shut down (a TPU preemption or a deleted node: SIGTERM, no notice) | `exited` | `stopped (SIGTERM)` |
| a slice's follower, stopped (its slice deleted or preempted) | `exited` | `follower stopped`, `follower leader_exit` or `follower idle` |
| killed (SIGKILL: it can write nothing more) | `idle` | anything: the last record its worker wrote |
| a failed boot (startup.sh) | `failed` | `<phase>_failed: ...` |

A machine recreated by its group is a boot of its own (the same name, a later boot): its record is
checked for its own ending, and must be written by that boot, not left from the one before.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from fleet.machines import parse_time

SELF_DELETED, PREEMPTED, FAILED_BOOT = "self-deleted", "preempted", "failed boot"
SHUT_DOWN, FOLLOWER_STOPPED, KILLED = "shut down", "follower stopped", "killed"
#: how a machine ended -> (the state its last record must have, a pattern its reason must match in full)
EXPECTED: dict[str, tuple[str, str]] = {
    SELF_DELETED: ("deleting", r"queue (drained|idle)"),
    PREEMPTED: ("exited", r"preempted"),
    # Cloud TPU shuts a preempted TPU VM down with no notice its worker can read
    # (https://cloud.google.com/tpu/docs/preemptible): the worker sees the shutdown's SIGTERM.
    SHUT_DOWN: ("exited", r"stopped \(SIGTERM\)"),
    FOLLOWER_STOPPED: ("exited", r"follower (stopped|leader_exit|idle)"),
    KILLED: ("idle", r".*"),
    FAILED_BOOT: ("failed", r"[a-z_]+_failed: .+"),
}
#: The reason of a boot refused the code (tests/boot/machines.refuse_code): startup.sh names the phase, the
#: account, the permission and the code's URL, as Cloud Storage's 403 words them.
CODE_REFUSED = (r"code_sync_failed: permission denied: \S+ does not have storage\.objects\.(list|get) access to the "
                r"Google Cloud Storage (bucket|object) gs://\S+ \(grant the machines' service account .+\)")
#: seconds of slack between a record's `at` (whole seconds) and the boot's own clock readings
CLOCK_SLACK_S = 2.0


@dataclasses.dataclass(frozen=True)
class Ending:
    """One boot of one machine as it stopped: its record then (None: there was none)."""

    machine: str
    boot: int
    how: str  # a key of EXPECTED
    record: dict | None
    started: float  # epoch seconds: the boot began (a record older than this is another boot's)
    ended: float  # epoch seconds: the boot stopped
    reason: str | None = None  # a pattern for the reason in full, where the rehearsal expects one more exactly

    @property
    def label(self) -> str:
        return f"{self.machine} (boot {self.boot}, {self.how})"


def problems(endings: list[Ending]) -> list[str]:
    """Every ending's record against what that ending must leave; each mismatch as a line."""
    out = []
    for ending in endings:
        if ending.how not in EXPECTED:
            out.append(f"{ending.label}: no expected record for an ending {ending.how!r} (one of {sorted(EXPECTED)})")
            continue
        state, reason = EXPECTED[ending.how]
        reason = ending.reason or reason
        record = ending.record
        if record is None:
            out.append(f"{ending.label}: no record in machines/{ending.machine}.json")
            continue
        at = parse_time(record.get("at"))
        if record.get("machine") != ending.machine:
            out.append(f"{ending.label}: the record names machine {record.get('machine')!r}")
        if record.get("state") != state or not re.fullmatch(reason, str(record.get("reason", ""))):
            out.append(f"{ending.label}: the last record says state={record.get('state')!r} "
                       f"reason={record.get('reason')!r}, not {state!r} with a reason matching {reason!r}")
        if at is None or not ending.started - CLOCK_SLACK_S <= at.timestamp() <= ending.ended + CLOCK_SLACK_S:
            out.append(f"{ending.label}: the last record was written at {record.get('at')!r}, not during this boot "
                       f"({_iso(ending.started)} to {_iso(ending.ended)}): another boot's, or stale")
    return out


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat(timespec="seconds")
