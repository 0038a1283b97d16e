"""The job-level index: one JSON document listing every shard a finished job wrote.

Built only from done markers (`done/<id>.json` under the queue prefix), whose `outputs` are the
progress records the spawner committed for that task, so the index lists exactly the shards that
count and none that a preempted holder left half-written.

Normalisation statistics: every shard stores, per output (hidden state or hook point), its token count,
per-dimension sum and sum of squares and the sum of token norms (activations.format); the index sums them per output
under `stats`, keyed by tensor name (`layer_12`, `mlp_out_3`; two small ranged reads per shard), so a trainer
normalises without an estimation pass. Shards written before the statistics existed leave `stats` null.

What the shards hold: each progress record names its shard's activation tensors (`activations`, absent in records
written before hook sites existed); the index lists them once, under `activations`, and refuses shards of one job
that disagree.

Rows the consumer skipped as bad (docs/EXTRACTION.md, "Bad rows") are counted in the records'
`counters.skipped_rows` and listed, a bounded number per task, in their `skipped`; the index sums
the counters into `totals` and keeps the first MAX_LISTED_SKIPPED listed rows of the job.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime as dt
import json
import logging

from activations.format import output_key
from activations.io import ActivationsError, ByteReader
from activations.reader import MissingStats, ShardRef, sum_stats  # numpy only, no JAX
from exitcodes import EX_FAILED
from objectstore import ObjectStore

log = logging.getLogger(__name__)

DONE_PREFIX = "done/"
INDEX_NAME = "index.json"
MAX_LISTED_SKIPPED = 1000
SKIPPED_ROWS = "skipped_rows"
_RECORD_FIELDS = {"shard": str, "bytes": int, "crc32c": str, "sample_start": int, "sample_end": int, "samples": int, "tokens": int}


class JobIndexError(Exception):
    """A done marker or one of its progress records is malformed or inconsistent; the message names it."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


@dataclasses.dataclass
class _TaskOutputs:
    task: str
    shards: list[dict]  # in sample order
    counters: collections.Counter  # summed over the task's distinct shard records
    skipped: list[dict]  # listed skipped rows, each with its task
    activations: dict[str, list[str]]  # each record's activation tensors (when it names them) -> its shards' urls


def _counters_and_skipped(name: str, i: int, record: dict) -> tuple[dict[str, int], list[dict]]:
    """A record's optional `counters` ({name: int}) and `skipped` (listed skipped rows), checked."""
    counters = record.get("counters", {})
    if not isinstance(counters, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values()):
        raise JobIndexError(f"done marker {name!r}: outputs[{i}] field 'counters' must map names to integers, got {counters!r}")
    skipped = record.get("skipped", [])
    if not isinstance(skipped, list) or not all(isinstance(entry, dict) for entry in skipped):
        raise JobIndexError(f"done marker {name!r}: outputs[{i}] field 'skipped' must be a list of objects, got {skipped!r}")
    return counters, skipped


def _shards_of(name: str, raw: bytes) -> _TaskOutputs:
    try:
        marker = json.loads(raw)
    except ValueError as err:
        raise JobIndexError(f"done marker {name!r} is not valid JSON: {err}") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("outputs"), list) or "task" not in marker:
        raise JobIndexError(f"done marker {name!r} needs 'task' and an 'outputs' list")
    task = str(marker["task"])
    shards = {}
    counters: collections.Counter = collections.Counter()
    skipped: list[dict] = []
    activations: dict[str, list[str]] = {}
    for i, record in enumerate(marker["outputs"]):
        for field, kind in _RECORD_FIELDS.items():
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise JobIndexError(f"done marker {name!r}: outputs[{i}] field {field!r} must be {kind.__name__}, got {value!r}")
        shard = {
            "url": record["shard"],
            "bytes": record["bytes"],
            "crc32c": record["crc32c"],
            "task": task,
            "sample_start": record["sample_start"],
            "sample_end": record["sample_end"],
            "samples": record["samples"],
            "tokens": record["tokens"],
        }
        # A holder may report the same shard twice (its last record re-sent on SIGTERM); it is one
        # shard, but only if both records say the same about it.
        if shard["url"] in shards and shards[shard["url"]] != shard:
            raise JobIndexError(f"done marker {name!r}: outputs[{i}] describes shard {shard['url']} differently than before")
        record_counters, record_skipped = _counters_and_skipped(name, i, record)
        names = record.get("activations")
        if names is not None:
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise JobIndexError(f"done marker {name!r}: outputs[{i}] field 'activations' must be a list of tensor names, got {names!r}")
            activations.setdefault(json.dumps(names), []).append(record["shard"])
        if shard["url"] not in shards:  # a re-sent record counts once
            counters.update(record_counters)
            skipped += [{"task": task, **entry} for entry in record_skipped]
        shards[shard["url"]] = shard
    ordered = sorted(shards.values(), key=lambda s: (s["sample_start"], s["sample_end"], s["url"]))
    for before, after in zip(ordered, ordered[1:]):
        if after["sample_start"] < before["sample_end"]:
            raise JobIndexError(
                f"done marker {name!r}: shards {before['url']} and {after['url']} cover overlapping samples "
                f"[{before['sample_start']}, {before['sample_end']}) and [{after['sample_start']}, {after['sample_end']})"
            )
    return _TaskOutputs(task, ordered, counters, skipped, activations)


def job_activations(per_task: list[_TaskOutputs]) -> list[str] | None:
    """The activation tensors every shard holds (from the records that name them); None when no record does."""
    seen: dict[str, str] = {}  # the tensor list (JSON) -> one shard holding it
    for outputs in per_task:
        for names, urls in outputs.activations.items():
            seen.setdefault(names, urls[0])
    if len(seen) > 1:
        (one, first), (other, second) = list(seen.items())[:2]
        raise JobIndexError(
            f"shards of this job hold different activations: {first} holds {json.loads(one)}, {second} holds "
            f"{json.loads(other)}; a queue holds one job"
        )
    return json.loads(next(iter(seen))) if seen else None


def job_stats(shards: list[dict], parallel: int = 16) -> tuple[dict | None, str | None]:
    """({tensor name: LayerStats JSON} summed over `shards` (index entries), None) or (None, why not).

    The index's shard list does not depend on the statistics, so a shard without them (written before they existed)
    or one that cannot be read leaves `stats` null with the reason in `stats_error`, and a warning is logged."""
    try:
        totals = sum_stats([ShardRef(url=s["url"]) for s in shards], ByteReader(), parallel)
    except (MissingStats, ActivationsError) as err:
        log.warning("event=index_without_stats reason=%r", str(err))
        return None, str(err)
    return {output_key(output): stats.to_json() for output, stats in totals.items()}, None


def build_index(store: ObjectStore, parallel: int = 16, stats: bool = True) -> dict:
    """Read every done marker under `store` (a queue prefix) and return the index document; with `stats`, also sum
    the shards' normalisation statistics."""
    names = [e.name for e in store.list(DONE_PREFIX) if e.name.endswith(".json")]
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        per_task = list(pool.map(lambda n: _shards_of(n, store.read(n).data), names))
    shards = sorted((s for outputs in per_task for s in outputs.shards), key=lambda s: (s["task"], s["sample_start"], s["url"]))
    counters: collections.Counter = collections.Counter()  # only counters some record has: no noise
    for outputs in per_task:
        counters.update(outputs.counters)
    skipped = sorted((e for outputs in per_task for e in outputs.skipped), key=lambda e: (e["task"], e.get("sample_id", 0)))
    return {
        "queue": store.root_url,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "totals": {
            "tasks": len(per_task),
            "shards": len(shards),
            "samples": sum(s["samples"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            **dict(sorted(counters.items())),
        },
        "shards": shards,
        "activations": job_activations(per_task),
        "skipped": skipped[:MAX_LISTED_SKIPPED],
        **dict(zip(("stats", "stats_error"), job_stats(shards, parallel) if stats and shards else (None, None))),
    }


def write_index(store: ObjectStore, index: dict, name: str = INDEX_NAME) -> str:
    store.put(name, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    url = store.url(name)
    totals = index["totals"]
    log.info(
        "event=index_written url=%s tasks=%d shards=%d skipped_rows=%d",
        url, totals["tasks"], totals["shards"], totals.get(SKIPPED_ROWS, 0),
    )  # fmt: skip
    return url
