"""Writing a job and its task manifests into a queue, create-only, so that resubmitting changes nothing."""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import datetime as dt
import functools
import hashlib
import json
import logging
import pathlib
import threading
from collections.abc import Iterable

from exitcodes import EX_DATAERR
from objectstore import NotFound, ObjectStore, PreconditionFailed
from taskqueue import layout
from taskqueue.clock import Clock

log = logging.getLogger(__name__)


class SubmitError(ValueError):
    """The job or tasks file cannot be submitted; the message names the file, line and field."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


@dataclasses.dataclass
class SubmitReport:
    created: int = 0
    existing: int = 0
    job: str = "none"  # created | existing | none

    def __str__(self) -> str:
        return f"event=submitted created={self.created} already_existed={self.existing} job={self.job}"


def read_tasks(path: pathlib.Path) -> list[tuple[str, bytes]]:
    """(id, manifest bytes) for every line of a JSON-lines file, or SubmitError naming the bad line."""
    tasks: list[tuple[str, bytes]] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                manifest = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SubmitError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(manifest, dict):
                raise SubmitError(f"{where}: a task must be a JSON object with an 'id' field")
            if "id" not in manifest:
                raise SubmitError(f"{where}: task is missing field 'id' (ids make submission idempotent)")
            try:
                task_id = layout.check_task_id(manifest["id"], where)
            except layout.BadManifest as exc:
                raise SubmitError(str(exc)) from None
            if task_id in first_line:
                raise SubmitError(f"{where}: task id {task_id!r} already used on line {first_line[task_id]}")
            first_line[task_id] = number
            data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
            if len(data) > layout.MAX_MANIFEST_BYTES:
                raise SubmitError(f"{where}: manifest is {len(data)} bytes, over the {layout.MAX_MANIFEST_BYTES}-byte limit")
            tasks.append((task_id, data))
    return tasks


def submit(
    store: ObjectStore,
    job: bytes | None,
    tasks: Iterable[tuple[str, bytes]],
    parallel: int = 16,
    clock: Clock | None = None,
    *,
    executor: concurrent.futures.Executor | None = None,
    region_tasks: int = layout.REGION_TASKS,
    batch_keep_s: float = layout.BATCH_KEEP_S,
) -> SubmitReport:
    """Create the job and the tasks, inside a batch marker (docs/PROTOCOL.md, "Batches").

    The marker is `running` before the first task is created and `done` only once every task
    exists (or this run gave up), the regions are cut and no swept marker covers one of them:
    while it runs, no worker takes a region it covers for swept, nor the queue for drained, and
    status does not call the queue complete.

    The creates run `parallel` at a time on `executor` (by default a thread pool of that size, made
    for this call). **The marker is never finished while one of them is in flight**: a submit that
    fails stops sending creates, waits for the ones in flight to be answered, and sends again every
    create whose answer it did not get (a create-if-absent that is answered settles it: a write the
    store applies late can no longer make the task appear), before it cuts, un-sweeps and finishes
    (`_give_up`). That is so for a task that exists with another manifest (SubmitError, after every
    other task is created), a store error, Ctrl-C and SIGTERM (`tools/submit.py`). A second
    interrupt while it waits leaves the batch `running`, and the note says so; so does a dead
    machine, or a store that refuses the finishing writes. A failure while the marker is begun may
    have left it written all the same: `_unbegin` settles that. Running the same submit again (the
    batch's name is made from its ids) takes the marker over and finishes it, and `finish_batch`
    finishes one whose submit will never run again. A finished submit deletes the `done` markers
    older than `batch_keep_s`, so `batches/` holds only recent batches.

    `region_tasks` is where `mark_regions` cuts (docs/PROTOCOL.md, "Regions"); a queue's submits
    should all use one size.
    """
    clock = clock or Clock()
    report = SubmitReport()
    tasks = list(tasks)
    ids = sorted((task_id for task_id, _ in tasks), key=layout.key)
    name = batch_name(ids)
    span = {"first": ids[0], "last": ids[-1], "tasks": str(len(ids))} if ids else {}
    _create_job(store, job, report)
    if not tasks:
        return report
    own_pool = executor is None
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="submit") if own_pool else executor
    creates = _Creates(store, tasks)
    cut = functools.partial(mark_regions, store, ids, parallel, executor=pool, region_tasks=region_tasks)
    try:
        try:
            generation = begin_batch(store, name, span)
        except (Exception, KeyboardInterrupt) as exc:
            _unbegin(store, name, span, clock, exc)
            raise
        marked = clock.monotonic()
        try:
            creates.run(pool, parallel, clock)
            cut()
            refused = creates.refused()
            _finish(store, name, generation, {**span, **({"refused": str(len(refused))} if refused else {})}, clock, marked)
        except (Exception, KeyboardInterrupt) as exc:
            # Not a dead machine (that runs no handler): finish the batch, or say that it is left running.
            _give_up(store, name, generation, span, creates, cut, clock, marked, exc)
            raise
    finally:
        if own_pool:
            # Settled already, unless a second interrupt cut the wait short: those threads end with their
            # create (and the interpreter waits for them at exit); no queued create starts any more.
            pool.shutdown(wait=False, cancel_futures=True)
    report.created, report.existing = creates.count(_CREATED), creates.count(_EXISTING)
    if refused:
        urls = [store.url(layout.task_object(t)) for t in refused]
        what = (f"{urls[0]} already exists" if len(urls) == 1 else
                f"{len(urls)} tasks already exist ({', '.join(urls[:3])}{', ...' if len(urls) > 3 else ''})")  # fmt: skip
        raise SubmitError(
            f"{what} with a different manifest: tasks are immutable, give the changed task a new id and submit "
            f"it. The batch's other {len(tasks) - len(refused)} tasks are submitted ({report.created} created "
            f"now) and its batch marker is finished."
        )
    prune_batches(store, name, batch_keep_s)
    return report


def _create_job(store: ObjectStore, job: bytes | None, report: SubmitReport) -> None:
    if job is None:
        return
    try:
        store.create(layout.JOB, job)
        report.job = "created"
    except PreconditionFailed:
        if json.loads(store.read(layout.JOB).data) != json.loads(job):
            raise SubmitError(
                f"{store.url(layout.JOB)} already exists with different content: "
                "submit a changed job to a new queue prefix"
            ) from None
        report.job = "existing"


def batch_name(task_ids: Iterable[str]) -> str:
    """`batches/<hash>.json`, the hash made from the batch's sorted ids: the same batch submitted
    again finds the same marker."""
    ids = sorted(task_ids, key=layout.key)
    return layout.batch_object(hashlib.sha256("\n".join(ids).encode()).hexdigest()[:24])


_CREATED, _EXISTING, _REFUSED, _UNKNOWN = "created", "existing", "refused", "unknown"
#: How often a submit waiting for its creates looks again; the last one to settle wakes it at once.
_SETTLE_POLL_S = 0.5


def _create(store: ObjectStore, task_id: str, data: bytes) -> str:
    """One task's create-if-absent: created, existing (the same manifest) or refused (another one)."""
    # The manifest rides in the metadata too, when small: workers read it from the tasks/ listing.
    copy = {"manifest": data.decode()} if len(data) <= layout.MANIFEST_METADATA_BYTES else None
    try:
        store.create(layout.task_object(task_id), data, metadata=copy)
        return _CREATED
    except PreconditionFailed:
        if json.loads(store.read(layout.task_object(task_id)).data) != json.loads(data):
            return _REFUSED
        return _EXISTING


class _Creates:
    """A batch's task creates, sent by jobs on an executor, and what became of each.

    A create is **in flight** from the moment a job takes its task until its answer is recorded.
    `stop()` lets no job take another task, so once it is called and `in_flight` is 0, no create of
    this submit can be answered any more: every task this run sent is `created`, `existing`,
    `refused`, or `unknown` (the request failed: the store may yet apply it, which `resolve`
    settles). Every create is tried, whatever the others' answers, unless one fails: then the
    submit is giving up, and sends no more.

    The jobs take tasks from one shared list, so a job that starts late (the executor was busy, or
    an interrupt came while it was being handed over) finds the list closed and does nothing: the
    count of creates in flight is exact whichever futures the caller got back.
    """

    def __init__(self, store: ObjectStore, tasks: list[tuple[str, bytes]]):
        self.store = store
        self._tasks = tasks
        self._next = 0
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self.in_flight = 0
        self.stopped = False
        self.outcomes: dict[str, str] = {}
        self.error: BaseException | None = None

    def run(self, executor: concurrent.futures.Executor, parallel: int, clock: Clock) -> None:
        """Every create, `parallel` at a time; raises the first failure once every create in flight settled."""
        for _ in range(max(1, min(parallel, len(self._tasks)))):
            executor.submit(self._job)
        self.wait(clock)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            self._update()

    def wait(self, clock: Clock) -> None:
        """Until no create is in flight and none can start. An interrupt (KeyboardInterrupt) ends it early."""
        while not self._quiet():
            clock.wait(self._settled, _SETTLE_POLL_S)

    def _quiet(self) -> bool:
        with self._lock:
            return self.in_flight == 0 and (self.stopped or self._next >= len(self._tasks))

    def _update(self) -> None:
        """Caller holds the lock."""
        if self.in_flight == 0 and (self.stopped or self._next >= len(self._tasks)):
            self._settled.set()

    def _take(self) -> tuple[str, bytes] | None:
        with self._lock:
            if self.stopped or self._next >= len(self._tasks):
                return None
            task = self._tasks[self._next]
            self._next += 1
            self.in_flight += 1
            return task

    def _answered(self, task_id: str, outcome: str, error: BaseException | None = None) -> None:
        with self._lock:
            self.outcomes[task_id] = outcome
            self.in_flight -= 1
            if error is not None:
                self.stopped = True
                self.error = self.error or error
            self._update()

    def _job(self) -> None:
        while (task := self._take()) is not None:
            task_id, data = task
            try:
                outcome = _create(self.store, task_id, data)
            except Exception as exc:  # noqa: BLE001 - recorded, and raised by `run` in the submitting thread
                self._answered(task_id, _UNKNOWN, exc)
            except BaseException as exc:  # an exit in this thread: the submitting thread raises it, and waits no more
                self._answered(task_id, _UNKNOWN, exc)
                raise
            else:
                self._answered(task_id, outcome)

    def resolve(self) -> None:
        """Send again every create whose answer never came: answered now (created, or 412), the task
        exists for good, and a copy of the first request that the store applies late changes
        nothing. Raises when the store fails again (the batch must then stay running)."""
        for task_id, data in self._tasks:
            if self.outcomes.get(task_id) == _UNKNOWN:
                # Refused or not, the task exists now: giving up, the submit compares no manifest.
                outcome = _create(self.store, task_id, data)
                self.outcomes[task_id] = _CREATED if outcome == _CREATED else _EXISTING

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)

    def refused(self) -> list[str]:
        return sorted((t for t, o in self.outcomes.items() if o == _REFUSED), key=layout.key)


def begin_batch(store: ObjectStore, name: str, span: dict[str, str]) -> int:
    """The batch marker, `running`: created, or rewritten when a run of the same batch made it
    before (finished or not). Returns its generation: finishing it is this run's job from now on
    (a run that rewrote it after us takes that job over, and our final write then gets a 412)."""
    metadata = {**span, "state": layout.BATCH_RUNNING}
    while True:
        try:
            return store.create(name, b"{}", metadata=metadata)
        except PreconditionFailed:
            pass
        try:
            # Running again even if it was done: this run may create tasks an earlier one did not.
            return store.write(name, b"{}", if_generation=store.read(name).generation, metadata=metadata)
        except (NotFound, PreconditionFailed):
            continue  # deleted (an old done batch) or rewritten in between: look again


def _finish(store: ObjectStore, name: str, generation: int, metadata: dict[str, str], clock: Clock, marked: float) -> None:
    """Rewrite the marker `done`, conditional on this run's `running` write."""
    # A small batch finishes within a second of its `running` write; GCS allows about one write per
    # second to an object (https://cloud.google.com/storage/quotas#objects), and the 429's backoff
    # would keep the batch `running`, its tasks out of waiting workers' sight, for several seconds.
    clock.wait(threading.Event(), store.same_object_write_gap_s - (clock.monotonic() - marked))
    try:
        store.write(name, b"{}", if_generation=generation, metadata={**metadata, "state": layout.BATCH_DONE})
    except (PreconditionFailed, NotFound):
        log.info("event=batch_taken_over batch=%s", name)  # a later run of the same batch finishes it


def _unbegin(store: ObjectStore, name: str, span: dict[str, str], clock: Clock, cause: BaseException) -> None:
    """After a failure while the marker was being begun (nothing created yet): the write may have been
    applied all the same (its answer lost, or applied by the store after we stopped waiting). A
    create of the marker settles it: if it succeeds, no run has the marker, and this one finishes it
    at once (a copy of the first write that lands later gets a 412); if the marker exists, it may be
    this run's or another run's, which may be creating tasks now, so it is left alone, and the note
    says how to finish it should it stay running."""
    marked = clock.monotonic()
    try:
        generation = store.create(name, b"{}", metadata={**span, "state": layout.BATCH_RUNNING})
    except PreconditionFailed:
        cause.add_note(f"{store.url(name)} exists, and may be running (this run's, whose answer was lost, or another "
                       f"run's): if status names it, run the same submit again")  # fmt: skip
        return
    except (Exception, KeyboardInterrupt) as exc:
        cause.add_note(f"{store.url(name)} may have been begun ({exc!r}): if status names it as running, run the same "
                       f"submit again")  # fmt: skip
        return
    try:
        _finish(store, name, generation, {**span, "gave_up": type(cause).__name__}, clock, marked)
    except (Exception, KeyboardInterrupt) as exc:
        cause.add_note(
            f"{store.url(name)} is left running ({exc!r}), with no task created: run the same submit again, or "
            f"finish its batch: gcs-spawner submit {store.root_url} --finish-batch {batch_id(name)}"
        )


def _give_up(
    store: ObjectStore,
    name: str,
    generation: int,
    span: dict[str, str],
    creates: _Creates,
    cut,
    clock: Clock,
    marked: float,
    cause: BaseException,
) -> None:
    """After a failure: stop sending creates and wait for the ones in flight, send again those whose
    answer never came, cut and un-sweep over every id of the batch (some may exist now), then
    finish the marker, so that nothing waits for a submit that has stopped. The marker is finished
    only once no create of this run can still make a task appear. If the store refuses any of it,
    or a second interrupt ends the wait, the batch stays `running`, and the cause gets a note
    saying how to finish it."""
    try:
        creates.stop()
        creates.wait(clock)
        creates.resolve()
        cut()
        _finish(store, name, generation, {**span, "gave_up": type(cause).__name__}, clock, marked)
        log.warning("event=batch_finished_after_failure batch=%s error=%r", name, cause)
    except (Exception, KeyboardInterrupt) as exc:  # the cause is raised all the same, with this as its note
        why = "interrupted again while its creates were in flight" if isinstance(exc, KeyboardInterrupt) else str(exc)
        log.error("event=batch_left_running batch=%s error=%r in_flight=%d", name, exc, creates.in_flight)
        cause.add_note(
            f"{store.url(name)} may be left running ({why}): run the same submit again, or, once it will never run "
            f"again, finish its batch: gcs-spawner submit {store.root_url} --finish-batch {batch_id(name)}"
        )


def batch_id(name: str) -> str:
    """`batches/<id>.json` -> `<id>`."""
    return name[len(layout.BATCHES) :].removesuffix(".json")


#: A submit prunes only when the last prune (PRUNED's `updated`) is between this and twice this older
#: than its own marker (where in between, its batch's name decides): GCS allows one write a second to
#: one object (https://cloud.google.com/storage/quotas#objects), and parallel submitters would
#: otherwise all rewrite PRUNED at once, and retry each other's 429s.
PRUNE_EVERY_S = 5.0


def prune_batches(store: ObjectStore, name: str, keep_s: float = layout.BATCH_KEEP_S) -> int:
    """Delete the `done` batch markers whose `updated` time is `keep_s` older than this submit's own
    marker `name` (both times are the store's, so no client clock matters); how many went.

    Before the first delete it rewrites layout.PRUNED, conditional on the generation listed, with
    `before` = the latest cutoff any prune used: a reader that lists `batches/` twice can then tell
    whether a marker may have come and gone between its listings (`layout.batch_unseen_between`).
    `updated` only grows (a lifecycle rule that changes an object's storage class moves it on,
    https://cloud.google.com/storage/docs/json_api/v1/objects#resource), so a marker is never
    deleted sooner than `keep_s` after its last write. Each delete is conditional on the generation
    listed: a marker a re-run made `running` again stays. A 412 on PRUNED means another submit is
    pruning: this one leaves it to it. A failure here costs nothing but a longer `batches/` listing
    until the next submit."""
    try:
        entries = list(store.list(layout.BATCHES))
        own = next((e for e in entries if e.name == name), None)
        mark = next((e for e in entries if e.name == layout.PRUNED), None)
        spread = int(batch_id(name)[:4], 16) / 0x10000 if name.startswith(layout.BATCHES) else 0.0
        if own is None or (mark is not None and (own.updated - mark.updated).total_seconds() < PRUNE_EVERY_S * (1 + spread)):
            return 0
        cutoff = own.updated - dt.timedelta(seconds=keep_s)
        stale = [e for e in entries if e.metadata.get("state") == layout.BATCH_DONE and e.updated < cutoff]
        if not stale:
            return 0
        earlier = (mark.metadata.get("before") if mark is not None else None) or cutoff.isoformat()
        before = {"before": max(cutoff, dt.datetime.fromisoformat(earlier)).isoformat()}
        try:
            if mark is None:
                store.create(layout.PRUNED, b"{}", metadata=before)
            else:
                store.write(layout.PRUNED, b"{}", if_generation=mark.generation, metadata=before)
        except PreconditionFailed:
            return 0  # another submit prunes now
        pruned = 0
        for entry in stale:
            try:
                store.delete(entry.name, if_generation=entry.generation)
                pruned += 1
            except (NotFound, PreconditionFailed):
                pass  # another submit pruned it, or a re-run made it running again
    except Exception as exc:  # noqa: BLE001 - housekeeping (a submitter may lack delete permission): the submit stands
        log.warning("event=batch_prune_failed error=%r", exc)
        return 0
    if pruned:
        log.info("event=batches_pruned count=%d", pruned)
    return pruned


def finish_batch(
    store: ObjectStore,
    batch: str,
    parallel: int = 16,
    *,
    executor: concurrent.futures.Executor | None = None,
    region_tasks: int = layout.REGION_TASKS,
) -> str:
    """Finish a `running` batch whose submit will never run again (its machine died); what was done.

    Every task in the batch's key range (its own, and any other batch's there) gets its region cut
    and un-swept, as its submit would have done, then the marker is rewritten `done`, conditional
    on the generation read. A submit still running would lose nothing but its protection: a worker
    could leave `drained` before its last tasks exist. So this is for a batch status has shown
    running long after its submit ended (a create its dead machine had sent may still be applied
    while the store works through it)."""
    name = batch if batch.startswith(layout.BATCHES) else layout.batch_object(batch)
    page = store.list_page(layout.BATCHES, start_offset=name, page_size=1)
    entry = next((e for e in page.entries if e.name == name), None)
    if entry is None:
        raise SubmitError(f"{store.url(name)} does not exist: `gcs-spawner status {store.root_url}` lists the running batches")
    if entry.metadata.get("state") == layout.BATCH_DONE:
        return f"event=batch_already_done batch={batch_id(name)}"
    first, last = entry.metadata.get("first"), entry.metadata.get("last")
    if not first or not last:
        raise SubmitError(f"{store.url(name)} has no 'first'/'last' metadata: it was not written by submit")
    ids = [t for t in (layout.id_from_object(e.name, layout.TASKS) for e in store.list(
        layout.TASKS, start_offset=layout.TASKS + layout.key(first), end_offset=layout.TASKS + layout.key(last))) if t]  # fmt: skip
    mark_regions(store, ids + [last], parallel, executor=executor, region_tasks=region_tasks)
    try:
        store.write(name, b"{}", if_generation=entry.generation, metadata={**entry.metadata, "state": layout.BATCH_DONE,
                                                                            "finished_by": "finish_batch"})  # fmt: skip
    except (PreconditionFailed, NotFound):
        raise SubmitError(
            f"{store.url(name)} changed while it was being finished: a submit of it is running again; leave it to finish"
        ) from None
    return f"event=batch_finished batch={batch_id(name)} tasks_in_range={len(ids)}"


def mark_regions(
    store: ObjectStore,
    task_ids: list[str],
    parallel: int = 16,
    *,
    executor: concurrent.futures.Executor | None = None,
    region_tasks: int = layout.REGION_TASKS,
) -> None:
    """Split markers that keep every region the batch touched at `region_tasks` tasks or fewer, and
    no swept marker left over any of its ids (docs/PROTOCOL.md, "Regions").

    Runs after the tasks exist, so a worker never sees a region's split before its tasks. Each
    region the batch added tasks to is listed whole (one request per thousand tasks, whoever
    created them) and cut at every `region_tasks`-th id, so regions stay about a thousand tasks
    whatever the batch sizes. A batch that lands inside a region some worker already swept
    un-sweeps it: the marker said every task there was finished, which is no longer true. The
    splits and un-sweeps go `parallel` at a time, on `executor` (else a thread pool of that size);
    it returns once all of them were answered.
    """
    if not task_ids:
        return
    keys = sorted(layout.key(t) for t in task_ids)
    starts = [layout.HEAD] + [t for t in (layout.id_from_object(e.name, layout.SPLITS) for e in store.list(layout.SPLITS)) if t]
    bounds = [layout.key(r) if r else "" for r in starts]
    splits = []
    for i, region in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else None
        first = bisect.bisect_left(keys, bounds[i])
        if first == len(keys) or (end is not None and keys[first] >= bounds[i + 1]):
            continue  # the batch added nothing here
        ids = [t for t in (layout.id_from_object(e.name, layout.TASKS) for e in store.list(
            layout.TASKS, start_offset=layout.TASKS + bounds[i] if region else None,
            end_offset=layout.TASKS + bounds[i + 1] if end is not None else None)) if t]  # fmt: skip
        # No split at the region's first id: it has one already (or is the head region).
        splits += ids[region_tasks::region_tasks]
    stale = []
    for entry in store.list(layout.SWEPT):
        region = layout.region_from_swept(entry.name)
        if region is None:
            continue
        start, end = layout.key(region) if region else "", entry.metadata.get("end") or None
        first = bisect.bisect_left(keys, start)
        if first < len(keys) and (end is None or keys[first] < layout.key(end)):
            stale.append(entry)

    def split(task_id: str) -> None:
        try:
            store.create(layout.split_object(task_id), b"{}")
        except PreconditionFailed:
            pass  # an earlier submission of the same batch wrote it

    def unsweep(entry) -> None:
        # Whatever its generation: a sweeper may be confirming it right now, and a marker deleted
        # needlessly only costs a sweep again.
        try:
            store.delete(entry.name)
        except NotFound:
            pass  # somebody else removed it

    if executor is not None:
        list(executor.map(split, splits))
        list(executor.map(unsweep, stale))
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="submit") as pool:
        list(pool.map(split, splits))
        list(pool.map(unsweep, stale))
