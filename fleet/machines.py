"""Machine records: `machines/<name>.json` under a queue prefix, one object per machine.

Contract (docs/PROTOCOL.md, "Machine records"):

- A record is written only by the machine it names, as a plain overwrite (`put`): no other writer
  exists, so no precondition is needed. `startup/startup.sh` writes the early states (booting,
  installing, and failed when the boot fails); the worker writes the rest (working, idle,
  deleting, failed) through the `on_state` hook that spawn.py injects into the queue's spawner.
- It is rewritten on every change of state and, while the worker runs, every `beat_s` seconds
  even without one, so a record older than a few beats belongs to a machine that went silent.
- The body is JSON (the schema below, with the log tail of a failure). The fields that `status`
  needs (state, task, reason, accelerator, code) are repeated as custom metadata, so one listing
  of `machines/` (one request per 1000 machines) is the whole cost of the fleet section.

Body fields: `machine` (name), `state` (one of STATES), `at` (UTC, ISO 8601), `code` (the code URL
it runs), `accelerator` (cpu | gpu | tpu), `zone`, and as the state needs: `task`, `reason`,
`log_tail`, `worker`. `role` and `hosts` are reserved for TPU slices (leader/follower, host count).
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import threading
from collections.abc import Mapping

from objectstore import ObjectStore, StoreError

log = logging.getLogger(__name__)

PREFIX = "machines/"
# fleet.specs names these attributes (ATTR_ACCELERATOR, ATTR_CODE; a test pins them equal); importing
# specs would pull google.cloud.compute_v1 into the worker's start for two strings.
ATTR_ACCELERATOR = "spawn-accelerator"
ATTR_CODE = "spawn-code"
STATES = ("booting", "installing", "working", "idle", "failed", "deleting", "exited")
#: States after which a machine is expected to stay silent.
FINAL_STATES = ("failed", "deleting", "exited")
#: Fields repeated as custom metadata so that a listing alone serves `status`.
LISTED_FIELDS = ("state", "task", "reason", "accelerator", "code", "role")
METADATA_VALUE_MAX = 512
DEFAULT_BEAT_S = 60.0
#: A record not refreshed for this many beats is reported as silent.
SILENT_BEATS = 3


class MachineRecordError(ValueError):
    """A machine record or a request to write one is malformed; the message names the field."""


def record_object(name: str) -> str:
    if not name or "/" in name:
        raise MachineRecordError(f"machine name {name!r} must be a non-empty name without '/'")
    return f"{PREFIX}{name}.json"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def make_record(name: str, state: str, at: dt.datetime | None = None, **fields: object) -> dict:
    """The record body; None-valued fields are left out."""
    if state not in STATES:
        raise MachineRecordError(f"machine record state {state!r} must be one of {', '.join(STATES)}")
    body = {"machine": name, "state": state, "at": (at or _now()).isoformat(timespec="seconds")}
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


def listed_metadata(body: Mapping[str, object]) -> dict[str, str]:
    return {k: str(body[k])[:METADATA_VALUE_MAX] for k in LISTED_FIELDS if body.get(k) is not None}


def write_record(store: ObjectStore, body: Mapping[str, object]) -> None:
    name = str(body["machine"])
    store.put(record_object(name), (json.dumps(body, sort_keys=True) + "\n").encode(), metadata=listed_metadata(body))


class MachineRecorder:
    """Writes this machine's record on every state change and refreshes it every `beat_s`.

    `set(state, **fields)` is the `on_state` hook the worker calls. Storage errors are logged and
    never raised: a record is for people watching the fleet, and must not stop the work."""

    def __init__(self, store: ObjectStore, name: str, beat_s: float = DEFAULT_BEAT_S, **base_fields: object):
        record_object(name)
        self.store = store
        self.name = name
        self.beat_s = beat_s
        self.base_fields = dict(base_fields)
        self._lock = threading.Lock()
        self._body: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, state: str, **fields: object) -> None:
        body = make_record(self.name, state, **{**self.base_fields, **fields})
        # One writer at a time: a beat must never overwrite a newer state with an older one.
        with self._lock:
            self._body = body
            if state in FINAL_STATES:
                self._stop.set()
            self._write(body)

    def _write(self, body: dict) -> None:
        try:
            write_record(self.store, body)
            log.info("event=machine_record machine=%s state=%s task=%s", self.name, body["state"], body.get("task", "-"))
        except StoreError as err:
            log.warning("event=machine_record_failed machine=%s state=%s error=%s", self.name, body["state"], err)

    def start(self) -> "MachineRecorder":
        self._thread = threading.Thread(target=self._beat, name="machine-record", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            with self._lock:
                if self._stop.is_set() or self._body is None:
                    continue
                body = {**self._body, "at": _now().isoformat(timespec="seconds")}
                self._write(body)


# ---- the fleet section of status -------------------------------------------------------------


def _age_s(entry_updated: dt.datetime, now: dt.datetime) -> float:
    updated = entry_updated if entry_updated.tzinfo else entry_updated.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (now - updated).total_seconds())


def fleet_snapshot(
    store: ObjectStore, now: dt.datetime | None = None, beat_s: float = DEFAULT_BEAT_S
) -> dict:
    """The fleet from one listing of `machines/`: counts by state, failures grouped by reason,
    machines silent for more than SILENT_BEATS beats, and the task each working machine is on."""
    now = now or _now()
    machines = []
    for entry in store.list(PREFIX):
        if not entry.name.endswith(".json"):
            continue
        meta = dict(entry.metadata)
        machines.append(
            {
                "machine": entry.name[len(PREFIX) : -len(".json")],
                "state": meta.get("state", "unknown"),
                "task": meta.get("task"),
                "reason": meta.get("reason"),
                "accelerator": meta.get("accelerator"),
                "code": meta.get("code"),
                "age_s": round(_age_s(entry.updated, now), 1),
            }
        )
    by_state = collections.Counter(m["state"] for m in machines)
    failures: dict[str, list[str]] = collections.defaultdict(list)
    for m in machines:
        if m["state"] == "failed":
            failures[m["reason"] or "unknown"].append(m["machine"])
    silent_after = SILENT_BEATS * beat_s
    silent = sorted(
        m["machine"] for m in machines if m["state"] not in FINAL_STATES and m["age_s"] > silent_after
    )
    return {
        "machines": len(machines),
        "by_state": dict(sorted(by_state.items())),
        "failures": {reason: sorted(names) for reason, names in sorted(failures.items())},
        "silent": silent,
        "silent_after_s": silent_after,
        "working": {m["machine"]: m["task"] for m in sorted(machines, key=lambda m: m["machine"]) if m["state"] == "working"},
    }


def render_fleet(view: Mapping) -> str:
    if not view["machines"]:
        return "fleet: no machine records (machines/ is empty)"
    states = "  ".join(f"{state}={count}" for state, count in view["by_state"].items())
    lines = [f"fleet: {view['machines']} machines  {states}"]
    for reason, names in view["failures"].items():
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5})" if len(names) > 5 else "")
        lines.append(f"  failed x{len(names)}: {reason}  [{shown}]")
    if view["silent"]:
        lines.append(f"  silent > {view['silent_after_s']:.0f}s: {', '.join(view['silent'])}")
    for machine, task in view["working"].items():
        lines.append(f"  {machine}: working on {task}")
    return "\n".join(lines)


def machine_name(metadata) -> str:
    """The record name of this machine: a VM's instance name; a TPU VM's node id (from `tpu-env`),
    with `-w<N>` for hosts other than worker 0. startup.sh computes the same name."""
    from fleet.selfdelete import parse_tpu_env

    tpu_env = metadata.attribute("tpu-env")
    if tpu_env:
        env = parse_tpu_env(tpu_env)
        node = env.get("NODE_ID")
        if node:
            worker = env.get("WORKER_ID", "0") or "0"
            return node if worker == "0" else f"{node}-w{worker}"
    return metadata.text("instance/name").strip()


def machine_identity(metadata) -> dict[str, str | None]:
    """`name` plus the fields every record of this machine carries: zone, accelerator, code URL, and
    the boot's permission verdict (`permissions`: granted or unverified, fleet.selfdelete)."""
    from fleet.selfdelete import saved_verdict

    return {
        "name": machine_name(metadata),
        "zone": metadata.text("instance/zone").strip().rsplit("/", 1)[-1],
        "accelerator": metadata.attribute(ATTR_ACCELERATOR),
        "code": metadata.attribute(ATTR_CODE),
        **saved_verdict(),
    }


def maybe_on_gce() -> bool:
    """Cheap first test, no network: GCE_METADATA_HOST is set (a test or a private setup), or the
    BIOS says Google (https://cloud.google.com/compute/docs/instances/detect-compute-engine). Off
    Google Cloud this spares every worker start the metadata probe's timeout."""
    import os

    if os.environ.get("GCE_METADATA_HOST"):
        return True
    try:
        with open("/sys/class/dmi/id/product_name") as handle:
            return handle.read().strip() in ("Google", "Google Compute Engine")
    except OSError:
        return False
