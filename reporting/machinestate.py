"""What a machine is doing now, read from its listed record: the one classification that status's
counts, charts, cost, burn rate and ETA all read.

A record says what its machine last wrote (fleet/machines.py); how old it is says whether that is
still true. The contract (docs/PROTOCOL.md, "Machine records"):

- A worker rewrites its record every beat (`beat_s`, listed with the record; 60 s by default). A
  `working` or `idle` record older than SILENT_AFTER_BEATS beats has missed its beat: the machine
  is `silent`. After LOST_AFTER_BEATS beats it is `lost`: presumed gone (preempted without a
  word, deleted under it, crashed).
- startup.sh's `booting` and `installing` records are written on changes only, so silence says
  nothing until BOOT_STUCK_S: past it such a machine is `lost` too (stuck, or gone).
- A final record (`failed`, `deleting`, `exited`) leaves the fleet at once; an `exited` record
  whose reason is `preempted` (the worker saw the preemption notice) reads `preempted`. A
  `deleting` record older than DELETING_GONE_S reads `exited`: by then the machine's delete went
  through, or it powered off (fleet/selfdelete.py).

Only the first four conditions (UP) are machines up: they count as up, burn money now, and carry
the ETA. A TPU slice is one worker: only its worker 0's record (`host` absent or 0) counts, is
priced, and is up or not.

Two clocks read a record. Its worker time (`counted_until`: the ETA's fleet size, stragglers)
runs to now while it is up and stops at its last record otherwise. Its billed time (`billed_until`:
the cost) runs as long as the machine may still exist as far as its records tell: a machine that
is not final is billed until it is declared lost (its last record plus the silence that makes it
lost: 3 beats, or 30 minutes for a boot record), since nothing in the bucket says it stopped before
that; a final record ends the bill at that record.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from fleet.machines import DEFAULT_BEAT_S, FINAL_STATES, PREFIX, SPENT_PREFIX, parse_time

#: Machines up: the record is fresh and says so.
UP = ("booting", "installing", "working", "idle")
#: Every condition, in the order status shows them.
CONDITIONS = (*UP, "silent", "lost", "failed", "preempted", "deleting", "exited", "unknown")
#: Conditions that want a person's eye (stragglers too, which are `working`).
ATTENTION = ("lost", "silent", "failed")
BOOT_STATES = ("booting", "installing")
WORKER_STATES = ("working", "idle")
#: A worker's record older than this many beats has missed one: the machine is silent.
SILENT_AFTER_BEATS = 1.5
#: ... and after this many it is presumed gone.
LOST_AFTER_BEATS = 3
#: Boot records are not refreshed: a machine booting or installing for longer than this without a
#: new record is stuck or gone (lost), and its time stops at its last record.
BOOT_STUCK_S = 1800.0
#: A `deleting` record older than this is a machine gone (`exited`). Its self-delete
#: (fleet/selfdelete.py) retries a failed request 6 times with waits of at most 30 s, waits at most
#: 300 s for the accepted operation, and powers off when that fails: under 10 minutes in all unless
#: the operation itself fails late and is retried (tests/status/test_fleet_view.py pins the
#: relation to SelfDeleter's defaults). A group member whose delete fails stays up, idle, with this
#: record (docs/CLOUD.md, "Self-deletion"): its log says so; the bucket cannot.
DELETING_GONE_S = 900.0


def _beat(text: str | None) -> float:
    try:
        beat = float(text) if text else DEFAULT_BEAT_S
    except ValueError:
        return DEFAULT_BEAT_S
    return beat if 0 < beat < float("inf") else DEFAULT_BEAT_S


def read_row(entry, now: dt.datetime) -> dict:
    """One listed record (`machines/<name>.json` with its custom metadata) as status reads it."""
    meta = dict(entry.metadata)
    spent = {key[len(SPENT_PREFIX) :]: int(v) for key, v in meta.items() if key.startswith(SPENT_PREFIX) and v.isdigit()}
    at = parse_time(meta["at"]) if "at" in meta else None
    updated = entry.updated if entry.updated.tzinfo else entry.updated.replace(tzinfo=dt.timezone.utc)
    return {
        "machine": entry.name[len(PREFIX) : -len(".json")],
        "state": meta.get("state", "unknown"),
        "task": meta.get("task"),
        "reason": meta.get("reason"),
        "accelerator": meta.get("accelerator"),
        "code": meta.get("code"),
        "machine_type": meta.get("machine_type"),
        "provisioning": meta.get("provisioning"),
        "host": meta.get("host"),
        "beat_s": _beat(meta.get("beat_s")),
        "at": at,
        "since": parse_time(meta["since"]) if "since" in meta else None,
        "spent": spent,
        # The machine's own last write when it says (a report `--now` some other time reads right), else the store's.
        "age_s": round(max(0.0, (now - (at or updated)).total_seconds()), 1),
    }


def is_worker(row: Mapping) -> bool:
    """The record that speaks for a worker: a VM's, or worker 0's of a TPU slice."""
    return row.get("host") in (None, "0")


def quiet_limits(row: Mapping) -> tuple[float, float]:
    """(silent after, lost after) in seconds of a record's age, for its state and beat."""
    if row["state"] in BOOT_STATES:
        return BOOT_STUCK_S, BOOT_STUCK_S
    return SILENT_AFTER_BEATS * row["beat_s"], LOST_AFTER_BEATS * row["beat_s"]


def classify(row: Mapping) -> str:
    """The machine's condition now (one of CONDITIONS), from its row's state and age."""
    state = row["state"]
    if state == "exited" and (row.get("reason") or "").startswith("preempted"):
        return "preempted"
    if state == "deleting" and row["age_s"] > DELETING_GONE_S:
        return "exited"
    if state in FINAL_STATES:
        return state
    if state not in UP:
        return "unknown"
    silent_after, lost_after = quiet_limits(row)
    if row["age_s"] > lost_after:
        return "lost"
    if row["age_s"] > silent_after:
        return "silent"
    return state


def counted_until(row: Mapping, now: dt.datetime) -> dt.datetime | None:
    """Until when the current spell of a machine counts: now while it is up; its last record
    otherwise (the final write, or the last sign of life of a silent or lost one). None when the
    record carries no times (written before they existed)."""
    if row["since"] is None:
        return None
    return now if classify(row) in UP else (row["at"] or row["since"])


def billed_until(row: Mapping, now: dt.datetime) -> dt.datetime | None:
    """Until when the current spell of a machine is priced: while the machine may still exist.

    A machine in a final state (`failed`, `deleting`, `exited`) is billed until that record (the
    minute a deletion takes after it is not seen). Any other is billed until now while it is up or
    silent, and once lost, until it was declared lost: its last record plus `quiet_limits`' lost
    time. Nothing in the bucket says when a lost machine stopped (a stuck boot is billed to this
    day; a spot VM preempted without a word stopped some time after its last record): this is the
    last moment its records said it might still run, so the price of a machine never drops when it
    turns from silent to lost. None when the record carries no times."""
    if row["since"] is None:
        return None
    last = row["at"] or row["since"]
    if row["state"] not in UP:  # a final record, or a state this code does not know
        return last
    return min(now, last + dt.timedelta(seconds=quiet_limits(row)[1]))


def worker_seconds_between(row: Mapping, start: dt.datetime, now: dt.datetime) -> float:
    """Seconds of [start, now] this machine spent as a worker (working or idle).

    Its worker time is taken as one stretch (a worker runs from its first claim to its final
    state): it ends at the start of a final spell, or where a working/idle spell is counted
    until, and is as long as its working and idle spells. Boot time is not worker time."""
    if row["since"] is None or not is_worker(row):
        return 0.0
    worker_s = float(row["spent"].get("working", 0) + row["spent"].get("idle", 0))
    if row["state"] in WORKER_STATES:
        end = counted_until(row, now) or row["since"]
        worker_s += max(0.0, (end - row["since"]).total_seconds())
    elif row["state"] in FINAL_STATES:
        end = row["since"]
    else:
        return 0.0
    begin = end - dt.timedelta(seconds=worker_s)
    return max(0.0, (min(end, now) - max(begin, start)).total_seconds())
