"""A lease as its holder sees it: every write conditional on the holder's own last generation.

The holder's fencing token is the generation of the write that gave it the lease. Each later write
(heartbeat, release, completion, dead letter) must match the generation of the holder's previous
write, so once anyone else has written the lease, the old holder can commit nothing more. A task
ends with its tombstone (the holder's last conditional write) and only then its done marker or
dead letter, copied from the tombstone: no marker is ever made by a holder that cannot prove,
with that write, that it still holds the lease.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence

from objectstore import NotFound, ObjectStore, PreconditionFailed
from taskqueue import layout
from taskqueue.clock import Clock

log = logging.getLogger(__name__)

HELD, RELEASED, DEAD, DONE = "held", "released", "dead", "done"
#: A lease in one of these states is a tombstone: its task is finished for good, nobody writes it again,
#: and its existence alone makes every later claim (create-if-absent) fail (docs/PROTOCOL.md, "Completion").
FINISHED = (DONE, DEAD)


class LeaseLost(Exception):
    """Someone else wrote or removed the lease: the holder must stop and commit nothing."""


def new_lease_body(task_id: str, worker: str, ttl_s: float, clock: Clock, previous: dict | None = None) -> dict:
    """The body a worker writes to claim a task; carries over progress, errors and takeovers."""
    previous = previous or {}
    errors = list(previous.get("errors", []))
    now = clock.wall_iso()
    return {
        "task": task_id,
        "state": HELD,
        "worker": worker,
        "nonce": uuid.uuid4().hex,
        "attempt": len(errors) + 1,
        "ttl_s": ttl_s,
        "claimed_at": now,
        "heartbeat_at": now,
        "progress": list(previous.get("progress", [])),
        "errors": errors,
        "takeovers": int(previous.get("takeovers", 0)) + (1 if previous.get("state") == HELD else 0),
    }


def sum_counters(records: Sequence[dict]) -> dict[str, int]:
    """The sum, per name, of the integer `counters` the consumer put in its progress records.

    The queue does not know what they count. A malformed entry is a consumer bug that must not
    cost the completion, so it is logged and left out of the sum.
    """
    totals: dict[str, int] = {}
    for record in records:
        counters = record.get("counters", {})
        if not isinstance(counters, dict):
            log.warning("event=bad_counters record=%s counters=%r: not an object, ignored", record.get("shard"), counters)
            continue
        for name, value in counters.items():
            if isinstance(value, int) and not isinstance(value, bool):
                totals[name] = totals.get(name, 0) + value
            else:
                log.warning(
                    "event=bad_counters record=%s name=%s value=%r: not an integer, ignored", record.get("shard"), name, value
                )
    return totals


def sum_metadata_counters(texts: Iterable[str]) -> dict[str, int]:
    """The same sum over `counters` metadata values (compact JSON) of done or swept markers."""
    records = []
    for text in texts:
        try:
            records.append({"counters": json.loads(text)})
        except ValueError:
            log.warning("event=bad_counters metadata=%r: not JSON, ignored", text[:200])
    return sum_counters(records)


def encode(body: dict) -> tuple[bytes, dict[str, str]]:
    """Body bytes and the listing-visible summary, written in one request so they never disagree."""
    metadata = {
        "state": body["state"],
        "worker": body["worker"],
        "ttl_s": str(body["ttl_s"]),
        "heartbeat_at": body["heartbeat_at"],
    }
    if body.get("counters"):
        # A `done` tombstone repeats its done marker's counters, so a sweep sums them from the leases listing.
        metadata["counters"] = compact(body["counters"])
    return json.dumps(body, separators=(",", ":")).encode(), metadata


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


#: How much of a dead letter's reason its custom metadata carries.
REASON_METADATA_CHARS = 200


def marker_of(tombstone: dict) -> tuple[str, bytes, dict[str, str] | None]:
    """The done marker or dead letter a tombstone stands for: name, body and custom metadata.

    The holder creates it right after its tombstone; a sweep creates it from the tombstone when the
    holder died in between. Both copy the same body, so whoever is first, the marker is the same.
    """
    task_id = tombstone["task"]
    if tombstone["state"] == DEAD:
        letter = {k: tombstone.get(k) for k in ("task", "reason", "errors", "worker", "fencing_token", "failed_at")}
        # The reason in the metadata too: status counts dead letters by reason from the listing alone.
        reason = {"reason": str(letter["reason"])[:REASON_METADATA_CHARS]} if letter.get("reason") else None
        return layout.failed_object(task_id), json.dumps(letter, indent=1).encode(), reason
    marker = {"task": task_id, "fencing_token": tombstone.get("fencing_token"), "worker": tombstone.get("worker"),
              "attempt": tombstone.get("attempt"), "outputs": tombstone.get("progress", []),
              "claimed_at": tombstone.get("claimed_at"), "completed_at": tombstone.get("completed_at"),
              "seconds": tombstone.get("seconds")}  # fmt: skip
    counters = tombstone.get("counters")
    # In the metadata, listings return the counters and times with the marker: status reads no body.
    metadata = {key: str(marker[key]) for key in ("completed_at", "seconds") if marker[key] is not None}
    if counters:
        metadata["counters"] = compact(counters)
    return layout.done_object(task_id), json.dumps(marker, indent=1).encode(), metadata or None


class HeldLease:
    """The lease a worker holds on one task. Thread-safe: the heartbeat thread shares it."""

    def __init__(self, store: ObjectStore, body: dict, generation: int, clock: Clock, sent_at: float | None = None):
        self.store = store
        self.task_id: str = body["task"]
        self.token = generation
        self.generation = generation
        self.body = body
        self.clock = clock
        # When our last confirmed write was sent (an observer's TTL can have started no earlier), and
        # when its answer came (GCS's one write per second per object counts from there).
        self.last_write = sent_at if sent_at is not None else clock.monotonic()
        self._answered = clock.monotonic()
        self.lost = False
        self._lock = threading.Lock()

    @property
    def attempt(self) -> int:
        return int(self.body["attempt"])

    @property
    def committed(self) -> list[dict]:
        return list(self.body["progress"])

    @property
    def output_prefix(self) -> str:
        return layout.output_prefix(self.task_id, self.token)

    def _write(self, body: dict) -> None:
        """Caller holds self._lock."""
        if self.lost:
            raise LeaseLost(f"lease on task {self.task_id} was already lost")
        if self.body["state"] in FINISHED:
            # A tombstone is final: a late release must never turn a finished task back into work.
            raise LeaseLost(f"lease on task {self.task_id} is already {self.body['state']}")
        data, metadata = encode(body)
        # Stamped when sent, not when acknowledged: an observer may have seen this write (and started
        # its TTL) as soon as it was applied, however late the answer comes.
        sent = self.clock.monotonic()
        try:
            self.generation = self.store.write(
                layout.lease_object(self.task_id), data, if_generation=self.generation, metadata=metadata
            )
        except (PreconditionFailed, NotFound) as exc:
            self.lost = True
            raise LeaseLost(f"lease on task {self.task_id} is no longer at generation {self.generation}: {exc}") from exc
        self.body = body
        self.last_write, self._answered = sent, self.clock.monotonic()

    def _updated(self, records: Sequence[dict], **changes: object) -> dict:
        body = dict(self.body)
        body["progress"] = self.committed + list(records)
        body["heartbeat_at"] = self.clock.wall_iso()
        body.update(changes)
        return body

    def heartbeat(self, records: Sequence[dict] = ()) -> None:
        """Renew, committing `records`. Raises LeaseLost."""
        with self._lock:
            self._write(self._updated(records))

    def release(self, records: Sequence[dict] = (), error: dict | None = None) -> None:
        """Give the task back: anyone may take it over at once. `error` records a failed attempt."""
        with self._lock:
            errors = list(self.body["errors"]) + ([error] if error else [])
            self._write(self._updated(records, state=RELEASED, errors=errors))

    def complete(self, records: Sequence[dict], started_mono: float) -> bool:
        """The `done` tombstone, then the done marker copied from it (docs/PROTOCOL.md, "Completion").

        The tombstone is a write conditional on our last generation: once it is applied, no other
        holder can ever get the lease, so the marker made from it is the only outcome the task can
        have. Raises LeaseLost (nothing was written, the outputs are abandoned) or StoreError (the
        tombstone may or may not be there: the caller must not count the task as finished). True:
        the completion is ours, whoever created the marker (a sweep may copy our tombstone first).
        """
        with self._lock:
            outputs = self.committed + list(records)
            self._settle(
                DONE,
                records,
                fencing_token=self.token,
                counters=sum_counters(outputs),
                completed_at=self.clock.wall_iso(),
                seconds=round(self.clock.monotonic() - started_mono, 3),
            )
            self._mark()
            return True

    def dead_letter(self, reason: str, records: Sequence[dict] = (), error: dict | None = None) -> None:
        """The `dead` tombstone, then the dead letter copied from it; raises like `complete`."""
        with self._lock:
            errors = list(self.body["errors"]) + ([error] if error else [])
            self._settle(
                DEAD, records, errors=errors, reason=reason, fencing_token=self.token, failed_at=self.clock.wall_iso()
            )
            self._mark()

    def _mark(self) -> None:
        """Create the marker of our tombstone. Caller holds self._lock."""
        name, data, metadata = marker_of(self.body)
        try:
            self.store.create(name, data, metadata=metadata)
        except PreconditionFailed:
            log.info("event=marker_exists task=%s object=%s copied_by=sweep", self.task_id, name)

    def settle(self, state: str, counters: dict | None = None) -> None:
        """Make our lease the tombstone (`done` or `dead`) of a task whose marker exists already (its
        holder died before writing the tombstone); `counters` are its done marker's."""
        with self._lock:
            try:
                self._settle(state, (), counters=counters)
            except LeaseLost as exc:
                log.warning("event=tombstone_refused task=%s state=%s error=%s", self.task_id, state, exc)

    def _settle(self, state: str, records: Sequence[dict], **fields: object) -> None:
        """The tombstone: the holder's final write, conditional like every other. Raises LeaseLost."""
        # GCS allows about one write per second to one object name, and a task often ends right after
        # a heartbeat: waiting out the rest of that second is cheaper than a 429 and its retry.
        wait = self.store.same_object_write_gap_s - (self.clock.monotonic() - self._answered)
        if wait > 0:
            self.clock.wait(threading.Event(), wait)
        self._write(self._updated(records, state=state, **{k: v for k, v in fields.items() if v}))
