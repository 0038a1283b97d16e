"""Machine records: `machines/<name>.json` under a queue prefix, one object per machine.

Contract (docs/PROTOCOL.md, "Machine records"):

- A record is written only by the machine it names, as a plain overwrite (`put`): no other writer
  exists, so no precondition is needed. `startup/startup.sh` writes the early states (booting,
  installing, and failed when the boot fails); the worker writes the rest (working, idle,
  deleting, failed) through the `on_state` hook that spawn.py injects into the queue's spawner.
- While the worker runs it is rewritten every `beat_s` seconds (the beat, written in the record),
  so a record that misses its beat belongs to a machine that went silent (reporting/machinestate.py
  reads it so). The first state and the final ones (failed,
  deleting, exited) are written at once; a change between `working` and `idle` (a new task
  included) is written by the next beat, so a fleet of back-to-back tasks writes one record per
  machine-minute, not two per task plus the beats. The time accounting stays exact: spells are
  kept in memory and every write carries them, so only the split of at most one beat between
  idle and working can be late, never the machine's total.
- A machine deleted by another hand (`gcs-spawner down`, or `gcs-spawner keep` deleting a machine the
  bucket has given up on while the cloud still had it) cannot write its own last record. The deleter writes a
  *deletion note* instead, `run/deleted/<name>.json` (DELETED_PREFIX; `note_deleted`): who, when, why. Its
  record stays the machine's alone; status reads a record older than its note as ended at the note
  (reporting/fleetview.py), so a deleted machine shows as deleted, never as up, and its bill stops there.
- The body is JSON (the schema below, with the log tail of a failure). The fields that `status`
  needs (state, task, reason, accelerator, code, and what the cost needs) are repeated as custom
  metadata, so one listing of `machines/` (one request per 1000 machines) is the whole cost of
  the fleet section, its cost so far included.
- Time is kept so that a listing alone gives machine-seconds by state: `since` is when the
  current spell began (a state, or a task while working), and `spent` the seconds of every
  earlier spell, summed per state. The worker carries on the spells startup.sh began, reading the
  record once when it starts, if that record is from the same boot (`boot_at`).

Body fields: `machine` (name), `state` (one of STATES), `at` (UTC, ISO 8601), `code` (the code URL
it runs), `accelerator` (cpu | gpu | tpu), `zone`, `machine_type` (the priced type: a TPU
accelerator type such as v5litepod-8, else the GCE machine type), `provisioning` (spot |
standard), `host` (a TPU VM's worker number; 0 speaks for the slice), `boot_at` (kernel boot,
UTC), `since`, `spent` ({state: seconds}), `beat_s` (the worker's beat), and as the state needs: `task`, `reason`, `log_tail`,
`worker`. `role` and `hosts` are reserved for TPU slices (leader/follower, host count).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import logging
import threading
from collections.abc import Callable, Mapping

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
#: Fields repeated as custom metadata so that a listing alone serves `status`; `spent` is listed
#: as one `spent_<state>` key per state (gcloud's --custom-metadata cannot carry commas).
LISTED_FIELDS = ("state", "task", "reason", "accelerator", "code", "role", "at", "since", "boot_at", "machine_type",
                 "provisioning", "host", "beat_s")  # fmt: skip
SPENT_PREFIX = "spent_"
METADATA_VALUE_MAX = 512
DEFAULT_BEAT_S = 60.0


class MachineRecordError(ValueError):
    """A machine record or a request to write one is malformed; the message names the field."""


#: Deletion notes: one per machine deleted by `down` or `keep` (see the contract above).
DELETED_PREFIX = "run/deleted/"


def note_deleted(store: ObjectStore, name: str, by: str, reason: str, at: dt.datetime | None = None) -> None:
    """Write the deletion note of machine `name` (the contract above): `by` the command, `reason` why."""
    at_text = _iso(at or _now())
    body = {"machine": name, "by": by, "reason": reason, "at": at_text}
    store.put(f"{DELETED_PREFIX}{name}.json", (json.dumps(body, sort_keys=True) + "\n").encode(),
              metadata={"by": by, "reason": reason[:500], "at": at_text}, content_type="application/json")


def deletion_notes(store: ObjectStore) -> dict[str, dict]:
    """machine name -> {"by", "reason", "at" (datetime)}, from one listing of DELETED_PREFIX."""
    notes = {}
    for entry in store.list(DELETED_PREFIX):
        if entry.name.endswith(".json"):
            meta = dict(entry.metadata)
            notes[entry.name[len(DELETED_PREFIX):-len(".json")]] = {
                "by": meta.get("by", "?"), "reason": meta.get("reason", ""), "at": parse_time(meta.get("at"))}
    return notes


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
    listed = {k: str(body[k])[:METADATA_VALUE_MAX] for k in LISTED_FIELDS if body.get(k) is not None}
    spent = body.get("spent") or {}
    if isinstance(spent, Mapping):
        listed.update({SPENT_PREFIX + state: str(int(seconds)) for state, seconds in sorted(spent.items())})
    return listed


def write_record(store: ObjectStore, body: Mapping[str, object]) -> None:
    name = str(body["machine"])
    store.put(record_object(name), (json.dumps(body, sort_keys=True) + "\n").encode(), metadata=listed_metadata(body))


def _iso(at: dt.datetime) -> str:
    return at.isoformat(timespec="seconds")


def parse_time(text: object) -> dt.datetime | None:
    """A record's ISO 8601 time (`at`, `since`, `boot_at`), UTC when it names no zone; None if it is not one."""
    try:
        at = dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)


def boot_time() -> dt.datetime | None:
    """When this machine's kernel booted (`btime` in /proc/stat): where its bill starts, give or
    take the firmware's seconds. startup.sh reads the same line."""
    try:
        with open("/proc/stat") as handle:
            for line in handle:
                if line.startswith("btime "):
                    return dt.datetime.fromtimestamp(int(line.split()[1]), dt.timezone.utc)
    except (OSError, ValueError) as exc:
        log.warning("event=boot_time_unknown error=%s", exc)
    return None


class MachineRecorder:
    """Writes this machine's record on every state change and refreshes it every `beat_s`.

    `set(state, **fields)` is the `on_state` hook the worker calls. Storage errors are logged and
    never raised: a record is for people watching the fleet, and must not stop the work.

    Every `set` ends the current spell (its seconds go to `spent[state]`) and starts a new one at
    `since`; `start()` first reads the record startup.sh wrote in this boot, to carry its spells on."""

    def __init__(
        self,
        store: ObjectStore,
        name: str,
        beat_s: float = DEFAULT_BEAT_S,
        now: Callable[[], dt.datetime] = _now,
        wait: Callable[[threading.Event, float], bool] | None = None,
        lock: contextlib.AbstractContextManager | None = None,
        **base_fields: object,
    ):
        """`now` (UTC), `wait(stop, seconds) -> stopped` and `lock` are the wall clock, the beat's
        sleep and the lock that orders writes; a simulation passes virtual ones (tests/simworld/fleet.py:
        its actors must wait for the lock on virtual time), production keeps the defaults."""
        record_object(name)
        self.store = store
        self.name = name
        self.beat_s = beat_s
        self.now = now
        self.wait = wait or (lambda stop, seconds: stop.wait(seconds))
        # Status reads a record that missed this beat as a machine gone silent (reporting/machinestate.py).
        self.base_fields = {"beat_s": beat_s, **base_fields}
        self._lock = lock or threading.Lock()
        self._body: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._spent: dict[str, float] = {}
        self._spell: tuple[str, dt.datetime] | None = None  # (state, since) of the current spell
        self._beating = False  # once beats run, working/idle changes wait for the next one
        self._published = False  # a record of this run has been written
        self._written: str | None = None  # the state of the record written last
        #: Writes attempted, by cause: "change" (written at once), "beat", and "deferred" (a change
        #: left to the next beat: the writes the beat rule saves). A benchmark reads them.
        self.writes: collections.Counter[str] = collections.Counter()

    def carry_on(self, boot_at: dt.datetime | None) -> None:
        """Take over the spells of this boot's record (startup.sh's booting and installing), one read.

        A record from another boot (or none, or an unreadable one) starts the count afresh."""
        if boot_at is None:
            return
        self.base_fields.setdefault("boot_at", _iso(boot_at))
        try:
            previous = json.loads(self.store.read(record_object(self.name)).data)
        except StoreError as err:
            log.info("event=machine_record_fresh machine=%s reason=%s", self.name, type(err).__name__)
            return
        except ValueError as err:
            log.warning("event=machine_record_unreadable machine=%s error=%s", self.name, err)
            return
        if not isinstance(previous, dict) or previous.get("boot_at") != _iso(boot_at):
            return
        spent = previous.get("spent") if isinstance(previous.get("spent"), dict) else {}
        self._spent = {k: float(v) for k, v in spent.items() if isinstance(v, (int, float)) and k in STATES}
        since = parse_time(previous.get("since"))
        if previous.get("state") in STATES and since is not None:
            # A worker restarted after a final state finds the machine still up: that gap was idle.
            state = previous["state"] if previous["state"] not in FINAL_STATES else "idle"
            self._spell = (state, since)

    def set(self, state: str, **fields: object) -> None:
        """End the current spell and start `state`'s. Written at once when it is the first state of
        this run or a final one, when no beat runs, or when it is a claim (`working`) while the record
        written last says anything else: a machine killed just after it claimed must not be left
        with an `idle` record. Any other `working`/`idle` change (`idle` after a task, the next task
        of a worker that claims back to back) waits for the next beat (at most `beat_s`)."""
        now = self.now()
        # One writer at a time: a beat must never overwrite a newer state with an older one.
        with self._lock:
            if self._spell is not None:
                previous, since = self._spell
                self._spent[previous] = self._spent.get(previous, 0.0) + max(0.0, (now - since).total_seconds())
            self._spell = (state, now)
            body = make_record(
                self.name, state, at=now, since=_iso(now), spent={k: round(v) for k, v in sorted(self._spent.items())},
                **{**self.base_fields, **fields},
            )  # fmt: skip
            self._body = body
            if state in FINAL_STATES:
                self._stop.set()
            claimed = state == "working" and self._written != "working"
            if self._beating and self._published and state not in FINAL_STATES and not claimed:
                self.writes["deferred"] += 1
                return
            self.writes["change"] += 1
            self._write(body)

    def _write(self, body: dict) -> None:
        self._published = True
        self._written = body["state"]
        try:
            write_record(self.store, body)
            log.info("event=machine_record machine=%s state=%s task=%s", self.name, body["state"], body.get("task", "-"))
        except Exception as err:  # noqa: BLE001 - a 403 or an expired credential too: the record must never stop the work
            log.warning("event=machine_record_failed machine=%s state=%s error=%s: %s", self.name, body["state"],
                        type(err).__name__, err)  # fmt: skip

    def start(self, carry_on: bool = False) -> "MachineRecorder":
        if carry_on:
            self.carry_on(boot_time())
        self._beating = True
        self._thread = threading.Thread(target=self.beat_loop, name="machine-record", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat_loop(self) -> None:
        """Refresh the record every `beat_s` until a final state or `stop()`: the thread `start()`
        runs, or a simulated actor on virtual time."""
        self._beating = True
        while not self.wait(self._stop, self.beat_s):
            self.beat()

    def beat(self) -> None:
        """One refresh: the current state with its spells up to date (a deferred change included)."""
        with self._lock:
            if self._stop.is_set() or self._body is None:
                return
            self._body = {**self._body, "at": _iso(self.now())}
            self.writes["beat"] += 1
            self._write(self._body)


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


def provisioning_model(metadata) -> str:
    """`spot` or `standard`, from `instance/scheduling/provisioning-model` (SPOT, STANDARD), else
    `instance/scheduling/preemptible` (TRUE for the older preemptible VMs, priced like spot VMs:
    https://cloud.google.com/compute/docs/instances/create-use-preemptible). Both are keys of the
    metadata server's `scheduling/` directory
    (https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys,
    https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice)."""
    from fleet.metadata import MetadataNotFound

    try:
        model = metadata.text("instance/scheduling/provisioning-model").strip().upper()
    except MetadataNotFound:
        model = ""
    if model in ("SPOT", "PREEMPTIBLE"):
        return "spot"
    if not model:
        try:
            if metadata.text("instance/scheduling/preemptible").strip().upper() == "TRUE":
                return "spot"
        except MetadataNotFound:
            pass  # neither key: an older server; the default model is standard
    return "standard"


def machine_identity(metadata) -> dict[str, str | None]:
    """`name` plus the fields every record of this machine carries: zone, accelerator, code URL,
    the boot's permission verdict (`permissions`: granted or unverified, fleet.selfdelete), and
    what its price depends on: the priced type (a TPU VM's `accelerator-type` attribute, which
    the TPU API sets, else the basename of `instance/machine-type`), the provisioning model, and a
    TPU VM's worker number (`host`: worker 0's record speaks for the slice's bill)."""
    from fleet.metadata import MetadataNotFound
    from fleet.selfdelete import parse_tpu_env, saved_verdict

    tpu_env = metadata.attribute("tpu-env")
    host = (parse_tpu_env(tpu_env).get("WORKER_ID") or "0") if tpu_env else None
    machine_type = metadata.attribute("accelerator-type")
    if not machine_type:
        try:
            machine_type = metadata.text("instance/machine-type").strip()
        except MetadataNotFound:
            machine_type = None  # its time is then counted as unpriced
    return {
        "name": machine_name(metadata),
        "zone": metadata.text("instance/zone").strip().rsplit("/", 1)[-1],
        "accelerator": metadata.attribute(ATTR_ACCELERATOR),
        "code": metadata.attribute(ATTR_CODE),
        "machine_type": machine_type.rsplit("/", 1)[-1] if machine_type else None,
        "provisioning": provisioning_model(metadata),
        "host": host,
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
