"""Where everything lives under a queue prefix, and what a valid task id and manifest are."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from collections.abc import Iterable, Mapping

JOB = "job.json"
TASKS = "tasks/"
LEASES = "leases/"
DONE = "done/"
FAILED = "failed/"
OUT = "out/"
SPLITS = "splits/"
SWEPT = "swept/"
BATCHES = "batches/"
#: A batch marker's `state`: `running` from before `submit` creates the batch's first task until
#: every task of it exists (or the submit gave up) and no swept marker covers one; then `done`.
BATCH_RUNNING, BATCH_DONE = "running", "done"
#: A `done` batch marker is deleted by a later `submit` once its `updated` time is this much older
#: than that submit's own marker's (both times the store's): a waiting worker, which lists `batches/`
#: at least every poll cap (60 s), has seen it as news twice by then (docs/PROTOCOL.md, "Batches").
BATCH_KEEP_S = 180.0
#: Rewritten by every submit that deletes done batch markers, before its first delete, with `before`
#: in its metadata: every marker deleted so far had an `updated` time earlier than that (the store's
#: time, ISO 8601). Not a batch (no `first`/`last`), and its name is no batch id.
PRUNED = BATCHES + "-pruned.json"


def pruned_mark(entry) -> tuple[int, str | None] | None:
    """What a listing of `batches/` says of PRUNED: its generation and `before`; None while there is none."""
    return None if entry is None else (entry.generation, entry.metadata.get("before"))


def batch_unseen_between(first: tuple[int, str | None] | None, second: tuple[int, str | None] | None,
                         newest_first: dt.datetime | None) -> bool:  # fmt: skip
    """Whether a batch marker may have been created and deleted between two listings of `batches/`,
    so that neither shows it: only if PRUNED changed in between and its `before` is later than the
    newest `updated` time of the first listing. A marker created after the first listing is newer
    than everything in it (the store's times order its writes), and a marker deleted is older than
    `before`. No clock of the reader's counts (docs/PROTOCOL.md, "Batches")."""
    if second is None or second == first:
        return False
    if newest_first is None or second[1] is None:
        return True
    return dt.datetime.fromisoformat(second[1]) > newest_first

#: Tasks per region: `submit` cuts every region it added tasks to at every REGION_TASKS-th id, so one
#: listing page (at most 1000 entries) covers a region's tasks whatever the batch sizes.
REGION_TASKS = 1000
#: The region before the first split (ids created outside `submit`, or a queue with no splits).
HEAD = ""
_HEAD_NAME = "-"  # not a valid task id, so it never collides with a real region start

TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_MANIFEST_BYTES = 64 * 1024
#: Manifests up to this size ride along in the tasks/ listing as custom metadata (GCS allows 8 KiB).
MANIFEST_METADATA_BYTES = 4 * 1024


class BadManifest(ValueError):
    """A task manifest that no worker can run; the message says what is wrong with it."""


def task_object(task_id: str) -> str:
    return f"{TASKS}{task_id}.json"


def lease_object(task_id: str) -> str:
    return f"{LEASES}{task_id}.json"


def done_object(task_id: str) -> str:
    return f"{DONE}{task_id}.json"


def failed_object(task_id: str) -> str:
    return f"{FAILED}{task_id}.json"


def split_object(task_id: str) -> str:
    return f"{SPLITS}{task_id}.json"


def swept_object(region: str) -> str:
    return f"{SWEPT}{region or _HEAD_NAME}.json"


def batch_object(batch_id: str) -> str:
    return f"{BATCHES}{batch_id}.json"


def region_from_swept(name: str) -> str | None:
    """`swept/-.json` -> HEAD; `swept/t1.json` -> `t1`; None for anything else."""
    if name == swept_object(HEAD):
        return HEAD
    return id_from_object(name, SWEPT)


def key(task_id: str) -> str:
    """Where an id sorts in listings: object names end in `.json`, and `t1.json` sorts after `t1.5.json`."""
    return task_id + ".json"


def swept(region: str, end: str | None, marker: Mapping[str, str] | None, running: Iterable[tuple[str, str]],
          whole_marker: bool = False) -> bool:  # fmt: skip
    """The swept rule, one for a worker's view and status alike (docs/PROTOCOL.md, "Swept regions"):
    the region from `region` to `end` (None: the end of the keyspace) is finished for good when its
    swept marker (`marker`, its listing metadata; None: there is none) is confirmed, covers the region
    to its end, and no batch still running (`running`: the first and last ids of each) meets it, since
    a submit still adding tasks there may be about to remove the marker.

    An unconfirmed marker never counts: its sweeper's second task listing may still withdraw it.
    `whole_marker`: the caller counts the region from the marker's counts (status), which stand for
    all the marker covers, from `region` to the marker's `end`; past the region's own end when a
    submit cut the region after the sweep. Then no running batch may meet any of that: it may be
    adding tasks the counts miss, even in a region cut from this one (sim seed 11605: a submitter
    killed halfway left its batch running in the cut-off part, and the old marker hid 19 of its
    tasks). A worker relies on the region alone."""
    if marker is None or not marker.get("confirmed"):
        return False
    covered = marker.get("end") or None
    if not (covered is None or (end is not None and key(covered) >= key(end))):
        return False
    start = key(region) if region else ""
    until = covered if whole_marker else end
    reach = key(until) if until else None
    return not any(start <= key(last) and (reach is None or key(first) < reach) for first, last in running)


def output_prefix(task_id: str, token: int) -> str:
    return f"{OUT}{task_id}/{token}"


_OBJECT_NAMES: dict[str, re.Pattern] = {}


def object_pattern(prefix: str) -> re.Pattern:
    """Matches the names of a prefix's queue objects, the task id as group 1: one regular expression
    for every entry of every listing (a thousand a page)."""
    pattern = _OBJECT_NAMES.get(prefix)
    if pattern is None:
        pattern = _OBJECT_NAMES[prefix] = re.compile(re.escape(prefix) + f"({TASK_ID.pattern})" + re.escape(".json"))
    return pattern


def id_from_object(name: str, prefix: str) -> str | None:
    """`tasks/t1.json` -> `t1`; None for anything that is not a queue object of that prefix. Interned:
    a worker's view holds each id of the regions it caches in several places (thousands of them)."""
    match = object_pattern(prefix).fullmatch(name)
    return sys.intern(match.group(1)) if match else None


def check_task_id(task_id: object, where: str) -> str:
    if not isinstance(task_id, str) or not TASK_ID.fullmatch(task_id):
        raise BadManifest(
            f"{where}: field 'id' must be a string of letters, digits, '.', '_' or '-' "
            f"(at most 128, not starting with a symbol), got {task_id!r}"
        )
    return task_id


def parse_manifest(data: bytes, expected_id: str, where: str) -> dict:
    """The manifest as a dict, or BadManifest naming the problem."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise BadManifest(f"{where}: manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadManifest(f"{where}: manifest is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise BadManifest(f"{where}: manifest must be a JSON object, got {type(manifest).__name__}")
    if "id" not in manifest:
        raise BadManifest(f"{where}: manifest is missing field 'id'")
    if check_task_id(manifest["id"], where) != expected_id:
        raise BadManifest(f"{where}: field 'id' is {manifest['id']!r} but the object is named for {expected_id!r}")
    return manifest
