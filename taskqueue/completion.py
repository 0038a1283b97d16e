"""Whether a queue is there, and when it is finished: the rules that status, the keeper, `down` and
the workers' exit all read (docs/PROTOCOL.md, "A queue is where its job is" and "Status").

Two rules, each written once:

- **A queue is where its job is.** `submit` writes `job.json` first, then a `running` batch marker,
  then the tasks (taskqueue/submit.py). A prefix with no `job.json` is not a queue, whatever
  listing it gives (a typo: `jobs/j1x` for `jobs/j1`), so a worker never takes it for drained and
  never writes a queue object into it. `wait_for_job` lets a worker that started before the
  submit wait a bounded time for it; then it raises `QueueMissing`, whose message names the URL.
  A bucket that does not exist is `QueueMissing` at once, naming the bucket.
- **Complete** (`QueueCount.complete`): at least one task was counted, every task counted has its
  done marker or dead letter, every region was counted (not an estimate), no batch is running (a
  submit in progress, or one that died), and `batches/` did not change while the counts were
  taken. A dead letter does not block completion (the job's outputs miss it: status names it).

Who reads them: `reporting.status.snapshot` builds a `QueueCount` from its listings and says
`complete` by it; the keeper (fleet/keeper.py, through the `work()` callable gcs_spawner/keep.py
gives it) and `down` stop on that `complete`; a worker (taskqueue/spawner.py) starts only after
`wait_for_job` and leaves `drained` only when its own view, as a `QueueCount`, is complete.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from objectstore import NotFound, ObjectStore, StoreError, StoreUnavailable, bucket_of
from taskqueue import layout
from taskqueue.clock import Clock

log = logging.getLogger(__name__)

#: How often a worker waiting for its job looks again (three requests a look at most).
JOB_POLL_S = 5.0


class QueueMissing(Exception):
    """The queue URL names no queue (no job.json under it, or no bucket at all); the message names
    the URL or the bucket and what to check. A worker records it and exits 65 (bad input)."""


@dataclasses.dataclass(frozen=True)
class QueueCount:
    """What one look at the queue counted, as the completion rule reads it."""

    total: int  # tasks counted
    unfinished: int  # of those, tasks with neither a done marker nor a dead letter
    submitting: int  # batch markers `running`
    steady: bool = True  # `batches/` was the same before and after the look
    counted_all: bool = True  # every open region was listed (False: an estimate from a sample)

    @property
    def complete(self) -> bool:
        return self.why_not() is None

    def why_not(self) -> str | None:
        """None when complete; else what keeps the queue from it, in a few words for a log line."""
        if self.submitting:
            return f"{self.submitting} batch(es) still submitting"
        if not self.steady:
            return "a batch changed while the queue was counted"
        if self.total <= 0:
            return "no task submitted yet"
        if not self.counted_all:
            return "an estimate counts a sample of the regions"
        if self.unfinished:
            return f"{self.unfinished} task(s) without a done marker or dead letter"
        return None


def read_job(store: ObjectStore) -> bytes:
    """job.json's bytes, as every consumer of the queue gets them. A worker starts only once its queue has one
    (`wait_for_job`) and nothing deletes it, so a missing one is `QueueMissing` naming it, never an empty job: a
    consumer handed `{}` would dead-letter the task for a fault that is not the task's."""
    try:
        return store.read(layout.JOB).data
    except NotFound:
        raise QueueMissing(f"{store.url(layout.JOB)} is missing: a queue keeps its job for good; check that the queue "
                           "was not deleted, or submit its job again (gcs-spawner submit QUEUE --job job.json)") from None


def dead_letters_note(store: ObjectStore) -> str:
    """What a worker adds to its last record's reason when it leaves a drained queue in which tasks
    ended as dead letters: ` with N dead letter(s)` and the command that lists them, since a finish
    whose outputs miss tasks is not a clean one (docs/PROTOCOL.md, "Status"); empty for a clean one.
    Counted from the confirmed swept markers' `failed` (every region of a drained queue has one):
    one request per thousand regions. A listing that fails adds nothing, and a log line says why."""
    try:
        failed = sum(int(e.metadata.get("failed") or 0) for e in store.list(layout.SWEPT) if e.metadata.get("confirmed"))
    except (StoreError, ValueError) as exc:
        log.warning("event=dead_letters_uncounted queue=%s error=%s", store.root_url, exc)
        return ""
    if not failed:
        return ""
    return f" with {failed} dead letter{'s' if failed != 1 else ''} (gcs-spawner status {store.root_url} --machines lists them)"


def find_job(store: ObjectStore) -> tuple[bytes | None, bool]:
    """(job.json's bytes or None, whether anything is submitted: a task or a batch marker). Raises
    QueueMissing at once when the bucket does not exist: an object read there is a 404 like a
    missing object, so a listing tells the two apart (a listing of an existing bucket is never a 404)."""
    try:
        job = store.read(layout.JOB).data
    except NotFound:
        job = None
        try:
            store.list_page("", page_size=1)
        except NotFound:
            bucket = store.root_url if bucket_of(store.root_url) is None else f"gs://{bucket_of(store.root_url)}"
            raise QueueMissing(
                f"bucket {bucket} does not exist: check the queue URL {store.root_url} (spawn-queue, --queue)"
            ) from None
    submitted = bool(store.list_page(layout.TASKS, page_size=1).entries) or bool(
        store.list_page(layout.BATCHES, page_size=1).entries
    )
    return job, submitted


def wait_for_job(
    store: ObjectStore, wait_s: float, clock: Clock | None = None, stop: threading.Event | None = None
) -> bytes | None:
    """job.json's bytes once the queue holds it and something is submitted (a task, or a batch
    marker: a submit under way); None if `stop` is set meanwhile. After `wait_s` without them it
    raises QueueMissing: "no job at URL" (nothing there: a typo, or a submit that never came) or
    "no task at URL" (a job with nothing submitted). Outages (StoreUnavailable) count as waiting.

    Cost: three requests a look (a GET and two one-entry listings), every JOB_POLL_S at most; a
    queue that is there costs one look."""
    clock = clock or Clock()
    stop = stop or threading.Event()
    deadline = clock.monotonic() + max(0.0, wait_s)
    poll = max(0.05, min(JOB_POLL_S, wait_s / 4)) if wait_s > 0 else 0.0
    job: bytes | None = None
    while True:
        try:
            job, submitted = find_job(store)
            if job is not None and submitted:
                return job
        except StoreUnavailable as err:
            log.warning("event=job_unreadable queue=%s error=%s", store.root_url, err)
        remaining = deadline - clock.monotonic()
        if remaining <= 0:
            break
        log.info("event=waiting_for_job queue=%s job=%s left_s=%.1f", store.root_url, job is not None, remaining)
        if clock.wait(stop, min(poll, remaining)):
            return None
    if job is None:
        raise QueueMissing(f"no job at {store.root_url}: check the queue URL (spawn-queue, --queue); "
                           f"gcs-spawner submit writes job.json there first")  # fmt: skip
    raise QueueMissing(f"no task at {store.root_url}: its job.json is there but no task was submitted "
                       f"(gcs-spawner submit {store.root_url} --tasks FILE)")  # fmt: skip
