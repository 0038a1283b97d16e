"""Writing a job and its task manifests into a queue, create-only, so that resubmitting changes nothing."""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import hashlib
import json
import pathlib
import threading
from collections.abc import Iterable

from objectstore import NotFound, ObjectStore, PreconditionFailed
from taskqueue import layout
from taskqueue.clock import Clock


class SubmitError(ValueError):
    """The job or tasks file cannot be submitted; the message names the file, line and field."""


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
) -> SubmitReport:
    """Create the job and the tasks, inside a batch marker (docs/PROTOCOL.md, "Batches").

    The marker is `running` before the first task is created and `done` only once every task
    exists, the regions are cut and no swept marker covers one of them: while it runs, no worker
    takes a region it covers for swept, nor the queue for drained. A submit that dies halfway
    leaves its batch `running` (workers then run what it created, and leave `idle`, never
    `drained`); running the same submit again finishes it, because the batch's name is made from
    its ids.
    """
    clock = clock or Clock()
    report = SubmitReport()
    if job is not None:
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

    tasks = list(tasks)
    if not tasks:
        return report
    ids = sorted((task_id for task_id, _ in tasks), key=layout.key)
    name = layout.batch_object(hashlib.sha256("\n".join(ids).encode()).hexdigest()[:24])
    span = {"first": ids[0], "last": ids[-1], "tasks": str(len(ids))}
    try:
        generation = store.create(name, b"{}", metadata={**span, "state": layout.BATCH_RUNNING})
    except PreconditionFailed:
        generation = store.read(name).generation  # the same batch submitted before: finish it
    marked = clock.monotonic()

    def create(task: tuple[str, bytes]) -> bool:
        task_id, data = task
        copy = {"manifest": data.decode()} if len(data) <= layout.MANIFEST_METADATA_BYTES else None
        try:
            store.create(layout.task_object(task_id), data, metadata=copy)
            return True
        except PreconditionFailed:
            if json.loads(store.read(layout.task_object(task_id)).data) != json.loads(data):
                raise SubmitError(
                    f"{store.url(layout.task_object(task_id))} already exists with a different manifest: "
                    "tasks are immutable, give the changed task a new id"
                ) from None
            return False

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        for created in pool.map(create, tasks):
            if created:
                report.created += 1
            else:
                report.existing += 1
    mark_regions(store, ids, parallel)
    # A small batch finishes within a second of its `running` write; GCS allows about one write per
    # second to an object (https://cloud.google.com/storage/quotas#objects), and the 429's backoff
    # would keep the batch `running`, its tasks out of waiting workers' sight, for several seconds.
    clock.wait(threading.Event(), store.same_object_write_gap_s - (clock.monotonic() - marked))
    try:
        store.write(name, b"{}", if_generation=generation, metadata={**span, "state": layout.BATCH_DONE})
    except PreconditionFailed:
        pass  # another run of the same batch finished it
    return report


def mark_regions(store: ObjectStore, task_ids: list[str], parallel: int = 16) -> None:
    """Split markers that keep every region the batch touched at REGION_TASKS tasks or fewer, and no
    swept marker left over any of its ids (docs/PROTOCOL.md, "Regions").

    Runs after the tasks exist, so a worker never sees a region's split before its tasks. Each
    region the batch added tasks to is listed whole (one request per thousand tasks, whoever
    created them) and cut at every REGION_TASKS-th id, so regions stay about a thousand tasks
    whatever the batch sizes. A batch that lands inside a region some worker already swept
    un-sweeps it: the marker said every task there was finished, which is no longer true.
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
        splits += ids[layout.REGION_TASKS :: layout.REGION_TASKS]
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

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(split, splits))
        list(pool.map(unsweep, stale))
