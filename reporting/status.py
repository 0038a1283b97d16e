"""Progress of a queue from its listings: counts, holders, stale leases, throughput, ETA, dead letters.

Completion times and task durations come from the done markers' listing (`completed_at` and
`seconds` metadata, docs/PROTOCOL.md); the ETA is a range, from the recent completion count.

The region map (docs/PROTOCOL.md, "Regions") keeps this cheap: a swept region is counted from its
marker, so only open regions are listed, and an estimate lists only a sample of them. Every
snapshot states its own cost in requests.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import datetime as dt
import json
import math
import random
import shlex
import statistics

from objectstore import ObjectStore, StoreError
from objectstore.base import Entry
from objectstore.counting import CountingStore
from taskqueue import completion, layout
from reporting import goodput
from taskqueue.lease import FINISHED, HELD, RELEASED, sum_metadata_counters
from taskqueue.slice import SLICES

RATE_WINDOW_S = 600.0  # throughput is measured over the last ten minutes of done markers
MAX_REASONS = 20  # dead letters read (one GET each) for their reason and first line
CURVE_POINTS = 60  # points of the completion curve
SNAPSHOT_TRIES = 3  # a snapshot is taken again when a batch changed while it listed (`complete` stays false after)
MAX_BLOCKERS = 20  # blockers of one kind named in the view (their count is given in full)


@dataclasses.dataclass
class RegionCache:
    """What `--watch` keeps between ticks: the task ids of regions still open.

    Done and failed markers only ever appear, and a swept region is finished for good (its marker
    carries its counts), so a tick lists only the done and failed markers of open regions; their
    task lists are re-listed every `TASKS_EVERY` ticks, or when the region is new.
    """

    tasks: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    ticks: int = 0
    #: With `history`: the (completed_at, seconds) of each swept region's done markers, listed once.
    swept_done: dict[str, list[tuple[dt.datetime, float | None]]] = dataclasses.field(default_factory=dict)


TASKS_EVERY = 10


def _regions(store: ObjectStore) -> tuple[list[str], dict[str, dict]]:
    splits = [layout.HEAD] + [t for t in (layout.id_from_object(e.name, layout.SPLITS) for e in store.list(layout.SPLITS)) if t]
    swept = {}
    for entry in store.list(layout.SWEPT):
        region = layout.region_from_swept(entry.name)
        if region is not None:
            swept[region] = dict(entry.metadata)
    return splits, swept


def _batches(store: ObjectStore) -> tuple[dict[str, Entry], tuple | None, dt.datetime | None]:
    """The batch markers written by `submit` (one request per thousand), by name; what the listing says
    of layout.PRUNED (`layout.pruned_mark`); and the newest `updated` time in it."""
    batches, pruned, newest = {}, None, None
    for e in store.list(layout.BATCHES):
        newest = e.updated if newest is None or e.updated > newest else newest
        if e.name == layout.PRUNED:
            pruned = layout.pruned_mark(e)
        elif e.metadata.get("first") and e.metadata.get("last"):
            batches[e.name] = e
    return batches, pruned, newest


def _running(batches: dict[str, Entry]) -> list[tuple[str, str]]:
    """The first and last ids of the batches whose submit has not finished."""
    return sorted((e.metadata["first"], e.metadata["last"]) for e in batches.values()
                  if e.metadata.get("state") != layout.BATCH_DONE)  # fmt: skip


def _region_of(splits: list[str], split_keys: list[str], task_id: str) -> str:
    return splits[bisect.bisect_right(split_keys, layout.key(task_id)) - 1]


def _range(prefix: str, start: str, end: str | None) -> dict:
    return {
        "start_offset": prefix + layout.key(start) if start else None,
        "end_offset": prefix + layout.key(end) if end else None,
    }


def snapshot(
    store: ObjectStore,
    now: dt.datetime | None = None,
    sample: int | None = None,
    seed: int | None = None,
    cache: RegionCache | None = None,
    history: bool = False,
) -> dict:
    """A JSON-ready summary, and what it cost (`requests`). Staleness uses the store's update times.

    Swept regions count from their markers alone. Open regions are listed (tasks, done markers and
    leases: three requests each), dead letters once for the whole queue; with `sample`, only that
    many open regions, chosen at random, and the counts of the others are extrapolated from them:
    the result then says `"estimate": true`, and holders and stale leases are those of the listed
    regions. (A finished task's lease stays as its tombstone, so leases are listed by region too.)

    With `history` (the status page's completion curve), the done markers of swept regions are
    listed too, once per region for a `cache` (they never change): one request per region, about
    one per 1000 finished tasks. Without it the curve starts at the swept regions' count.

    `complete` is never premature, however submits interleave with the listings: `batches/` is
    listed before everything else and again after, and the queue is complete only if both
    listings are the same, with no batch running, and every task counted has a marker. A submit
    creates tasks only while its batch marker is `running`, so any task created while this
    snapshot listed shows as a batch new, changed or running in one of the two listings; a swept
    marker is removed only by a running submit (docs/PROTOCOL.md, "Status"). When a batch changed
    in between, the snapshot is taken again (up to SNAPSHOT_TRIES times), since its counts may be
    off too; `blockers` says what keeps the queue from completing, and what clears it.
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    counted = CountingStore(store)
    for _ in range(SNAPSHOT_TRIES):
        before, pruned_before, newest = _batches(counted)
        view = _listed(counted, _running(before), now, sample, seed, cache, history)
        after, pruned_after, _ = _batches(counted)
        # Submits delete done markers BATCH_KEEP_S old, and say so in layout.PRUNED before they do: a batch
        # that began after the first listing and was deleted before the second shows there, and nowhere
        # else. (No clock of ours decides it: one that stopped while the machine was suspended would not.)
        steady = {n: e.generation for n, e in before.items()} == {n: e.generation for n, e in after.items()} and (
            not layout.batch_unseen_between(pruned_before, pruned_after, newest)
        )
        if steady:
            break
    submitting = _running(after)
    view["submitting"] = [first for first, _ in submitting]
    # The one completion rule (taskqueue/completion.py), which the keeper and `down` read from here.
    progress = completion.QueueCount(total=view["total"], unfinished=view.pop("unfinished"),
                                     submitting=len(submitting), steady=steady, counted_all=not view["estimate"])
    view["complete"] = progress.complete
    unfinished = [e for e in after.values() if e.metadata.get("state") != layout.BATCH_DONE]
    view["blockers"] = blockers(view, unfinished, now)
    # How many of each kind there are: `blockers` names at most MAX_BLOCKERS of a kind (and only the
    # MAX_REASONS dead letters read), so a view that says "N more" counts from these.
    view["blockers_total"] = {"batch": len(unfinished), "stale_lease": view["stale"], "dead_letter": view["failed"]}
    view["requests"] = counted.requests
    view["requests_by_kind"] = dict(sorted(counted.counts.items()))
    return view


def _listed(
    counted: CountingStore,
    running: list[tuple[str, str]],
    now: dt.datetime,
    sample: int | None,
    seed: int | None,
    cache: RegionCache | None,
    history: bool,
) -> dict:
    """The view from the listings of the regions, given the batches running before them; its
    `unfinished` counts the tasks without a marker (`snapshot` adds the batches and decides `complete`)."""
    splits, swept_markers = _regions(counted)
    ends = {r: (splits[i + 1] if i + 1 < len(splits) else None) for i, r in enumerate(splits)}

    # A region a running batch meets is listed, whatever its swept marker says: the batch may be
    # adding tasks there (docs/PROTOCOL.md, "Batches"). Its counts come from its marker: the whole of
    # what the marker covers must be free of running batches.
    def is_swept(region: str) -> bool:
        return layout.swept(region, ends[region], swept_markers.get(region), running, whole_marker=True)

    # A marker written before `submit` cut its region covers the regions cut from it too (its `end`
    # is the old one): those count from it, once, not from their own markers or listings.
    swept, open_regions, covered_until = [], [], ""
    for region in splits:
        start = layout.key(region) if region else ""
        if covered_until is None or (covered_until and start < covered_until):
            continue
        if is_swept(region):
            swept.append(region)
            end = swept_markers[region].get("end") or None
            covered_until = layout.key(end) if end else None
        else:
            open_regions.append(region)
    listed = open_regions
    if sample is not None and sample < len(open_regions):
        listed = sorted(random.Random(seed).sample(open_regions, sample), key=splits.index)
    tasks: set[str] = set()
    done_times: dict[str, dt.datetime] = {}
    task_seconds: list[float] = []
    failed: set[str] = set()
    counter_texts: list[str] = []
    leased, stale, released = [], [], []
    holders: collections.Counter[str] = collections.Counter()
    if cache is not None:
        cache.ticks += 1
        for region in list(cache.tasks):
            if region not in listed:
                del cache.tasks[region]
    for region in listed:
        where = dict(zip(("start", "end"), (region, ends[region])))
        if cache is not None and region in cache.tasks and cache.ticks % TASKS_EVERY:
            tasks |= cache.tasks[region]
        else:
            ids = {layout.id_from_object(e.name, layout.TASKS) for e in counted.list(layout.TASKS, **_range(layout.TASKS, **where))} - {None}
            tasks |= ids
            if cache is not None:
                cache.tasks[region] = ids
        for entry in counted.list(layout.DONE, **_range(layout.DONE, **where)):
            task_id = layout.id_from_object(entry.name, layout.DONE)
            if task_id:
                done_times[task_id] = _completed_at(entry)
                if _seconds(entry) is not None:
                    task_seconds.append(_seconds(entry))
                if "counters" in entry.metadata:  # the task's progress-record counters, summed by lease.complete
                    counter_texts.append(entry.metadata["counters"])
        for entry in counted.list(layout.LEASES, **_range(layout.LEASES, **where)):
            task_id = layout.id_from_object(entry.name, layout.LEASES)
            state = entry.metadata.get("state", HELD)
            if not task_id or task_id in done_times or state in FINISHED:
                continue
            if state == RELEASED:
                released.append(task_id)
                continue
            worker = entry.metadata.get("worker", "?")
            silent = (now - entry.updated).total_seconds()
            ttl = float(entry.metadata.get("ttl_s", "inf"))
            if silent > ttl:
                stale.append({"task": task_id, "worker": worker, "silent_s": round(silent, 1)})
            else:
                leased.append(task_id)
                holders[worker] += 1
    swept_done: list[tuple[dt.datetime, float | None]] = []
    if history:
        known = cache.swept_done if cache is not None else {}
        for region in swept:
            if region not in known:
                where = dict(zip(("start", "end"), (region, ends[region])))
                known[region] = [(_completed_at(e), _seconds(e)) for e in counted.list(layout.DONE, **_range(layout.DONE, **where))]
            swept_done.extend(known[region])
        task_seconds.extend(s for _, s in swept_done if s is not None)
    # Dead letters are few: one listing of failed/ for the whole queue, kept to the listed regions.
    listed_set = set(listed)
    split_keys = [layout.key(r) if r else "" for r in splits]
    every_failed = set()  # for the reasons shown, whichever region; counts come from markers or listed regions
    listed_reasons: collections.Counter[str | None] = collections.Counter()  # every dead letter's, by its metadata
    for entry in counted.list(layout.FAILED):
        task_id = layout.id_from_object(entry.name, layout.FAILED)
        if task_id:
            every_failed.add(task_id)
            listed_reasons[entry.metadata.get("reason")] += 1
            if _region_of(splits, split_keys, task_id) in listed_set:
                failed.add(task_id)
    # Counts of the listed open regions, scaled up to every open region when only a sample was listed.
    scale = len(open_regions) / len(listed) if listed else 0.0
    open_total = len(tasks | set(done_times) | failed) * scale
    open_done, open_failed = len(done_times) * scale, len(failed) * scale
    swept_tasks = sum(int(swept_markers[r].get("tasks", 0)) for r in swept)
    swept_failed = sum(int(swept_markers[r].get("failed", 0)) for r in swept)
    total = round(swept_tasks + open_total)
    done = round(swept_tasks - swept_failed + open_done)
    failed_count = round(swept_failed + open_failed)
    remaining = total - done - failed_count
    n_leased, n_stale, n_released = (round(len(x) * scale) for x in (leased, stale, released))
    pending = max(0, remaining - n_leased - n_stale)
    # A slice is one claimant: its leader holds the leases; its assignment says how many hosts it has.
    slice_hosts = {e.metadata["leader"]: int(e.metadata["hosts"]) for e in counted.list(SLICES)
                   if e.metadata.get("leader") in holders and e.metadata.get("hosts", "").isdigit()}  # fmt: skip
    def in_window(t: dt.datetime) -> bool:
        return 0 <= (now - t).total_seconds() <= RATE_WINDOW_S

    recent = [t for t in done_times.values() if in_window(t)]
    recent_swept = [t for t, _ in swept_done if in_window(t)]  # listed in full, so not scaled
    n_recent = len(recent) + len(recent_swept)
    rate = rate_low = rate_high = None
    if n_recent >= 2:
        span = max((now - min(recent + recent_swept)).total_seconds(), 1.0)
        counted_recent = len(recent) * scale + len(recent_swept)
        rate = counted_recent / span
        # A count of n completions is known to about +-2 sqrt(n) (Poisson, ~95%): the ETA's range.
        margin = 2 * math.sqrt(n_recent) * counted_recent / n_recent
        rate_low = max(0.0, counted_recent - margin) / span
        rate_high = (counted_recent + margin) / span
    reasons_for = sorted(every_failed)[:MAX_REASONS]
    counters, phase_counters = goodput.split_counters(sum_metadata_counters(
        [*counter_texts, *(swept_markers[r]["counters"] for r in swept if "counters" in swept_markers[r])]
    ))  # fmt: skip
    return {
        "queue": counted.root_url,
        "estimate": len(listed) < len(open_regions),
        "total": total,
        "pending": pending,
        "leased": n_leased,
        "stale": n_stale,
        "released": n_released,
        "done": done,
        "failed": failed_count,
        "holders": dict(sorted(holders.items())),
        "slice_hosts": dict(sorted(slice_hosts.items())),
        "stale_leases": sorted(stale, key=lambda s: s["task"]),
        "tasks_per_s": round(rate, 4) if rate else None,
        "eta_s": round(remaining / rate, 1) if rate and remaining else (0.0 if not remaining else None),
        "eta_range_s": _eta_range(remaining, rate_low, rate_high),
        "recent_done": n_recent,
        "rate_window_s": RATE_WINDOW_S,
        # Where the rate's span begins (the first completion in the window): the fleet's size is averaged over it.
        "rate_since": min(recent + recent_swept).isoformat(timespec="seconds") if rate else None,
        "median_task_s": round(statistics.median(task_seconds), 3) if task_seconds else None,
        "curve": _curve(sorted(done_times.values()), sorted(t for t, _ in swept_done), now, scale,
                        0 if history else round(swept_tasks - swept_failed)),
        **_reasons(counted, reasons_for),
        # Every dead letter by reason, from the listing (those written before it listed the reason are left out).
        "failed_by_reason": dict(sorted((r, n) for r, n in listed_reasons.items() if r is not None)),
        # Exact for swept and listed regions; an estimate counts only what it listed. The consumers' phase
        # counters are summarised apart (reporting/goodput.py).
        "counters": dict(sorted(counters.items())),
        "goodput": goodput.summary(phase_counters),
        # From markers only: swept regions count their done markers and dead letters (the sweep listed
        # them), open ones are listed; `snapshot` decides `complete` from it and the batches.
        "unfinished": remaining,
        "regions": {"total": len(splits), "swept": len(swept), "open": len(open_regions), "listed": len(listed)},
    }


def blockers(view: dict, running: list[Entry], now: dt.datetime) -> list[dict]:
    """What keeps the queue from completing, each with the command that clears it.

    - a batch still `running`: a submit in progress, or one that died (it leaves its batch running;
      every other failure finishes it). Running that submit again finishes it; so does
      `gcs-spawner submit QUEUE --finish-batch` once the submit will never run again.
    - a stale lease: held by a worker silent for over its TTL. Any running worker takes it over
      within its polls; none does if none is left, so the command starts one.
    - a dead letter: the queue completes with it, the job's outputs do not. Tasks and their
      outcomes are immutable: the task runs again under a new id, once its cause is fixed.
    """
    queue = shlex.quote(view["queue"])
    found: list[dict] = []
    for entry in sorted(running, key=lambda e: e.updated)[:MAX_BLOCKERS]:
        batch = entry.name[len(layout.BATCHES) :].removesuffix(".json")
        found.append({
            "kind": "batch", "batch": batch, "first": entry.metadata["first"], "last": entry.metadata["last"],
            "tasks": int(entry.metadata["tasks"]) if entry.metadata.get("tasks", "").isdigit() else None,
            "running_s": round(max(0.0, (now - entry.updated).total_seconds()), 1),
            "clear": f"wait for its submit, or run that submit again; if it will never run again: "
                     f"gcs-spawner submit {queue} --finish-batch {batch}",
        })  # fmt: skip
    for stale in view["stale_leases"][:MAX_BLOCKERS]:
        found.append({
            "kind": "stale_lease", **stale,
            "clear": f"any running worker takes it over; with none left, start one: "
                     f"python spawn.py {queue} --consumer 'python consume.py'",
        })  # fmt: skip
    for task_id, reason in list(view["failed_reasons"].items())[:MAX_BLOCKERS]:
        found.append({
            "kind": "dead_letter", "task": task_id, "reason": reason,
            "clear": f"fix the cause, then submit the task again under a new id: gcs-spawner submit {queue} "
                     f"--tasks FILE (tasks and their outcomes are immutable)",
        })  # fmt: skip
    return found


def render_blockers(view: dict, limit: int | None = None) -> list[str]:
    """The text view's section on what blocks completion: one line per kind, its command once; at most
    `limit` names per kind (a thousand dead letters must not fill the screen), and how many more there
    are, counted from `blockers_total` (the view names at most MAX_BLOCKERS of a kind)."""
    totals = view.get("blockers_total") or {}

    def names(blockers: list[dict], name) -> str:
        shown = blockers[:limit]
        more = totals.get(blockers[0]["kind"], len(blockers)) - len(shown)
        if more <= 0:
            return ", ".join(name(b) for b in shown)
        if limit is None:  # --machines: all that the view read, and what it did not read, said so
            return ", ".join(name(b) for b in shown) + (f", and {more:,} more that status does not read (it reads "
                                                        f"at most {MAX_BLOCKERS} of a kind)")
        return ", ".join(name(b) for b in shown) + f", ... {more:,} more (--machines lists up to {MAX_BLOCKERS})"

    kinds: dict[str, list[dict]] = collections.defaultdict(list)
    for blocker in view.get("blockers", []):
        kinds[blocker["kind"]].append(blocker)
    lines = []
    if kinds["batch"]:
        running = names(kinds["batch"], lambda b: f"{b['batch']} ({b['first']}..{b['last']}, {duration_text(b['running_s'])})")
        lines.append(f"blocked {totals.get('batch', len(kinds['batch']))} batch(es) running: {running}")
        lines.append(f"        {kinds['batch'][0]['clear']}")
    if kinds["stale_lease"]:
        lines.append(f"blocked {view['stale']} stale lease(s): " + names(kinds["stale_lease"], lambda b: b["task"]))
        lines.append(f"        {kinds['stale_lease'][0]['clear']}")
    if kinds["dead_letter"]:
        lines.append(f"blocked {view['failed']} dead letter(s): " + names(kinds["dead_letter"], lambda b: b["task"]))
        lines.append(f"        {kinds['dead_letter'][0]['clear']}")
    return lines


def _seconds(entry) -> float | None:
    """The task's duration from its done marker's `seconds` metadata, if it has one."""
    try:
        seconds = float(entry.metadata.get("seconds", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) else None


def _completed_at(entry) -> dt.datetime:
    """The worker's `completed_at` from the marker's metadata; the store's update time for markers
    written before it was there."""
    text = entry.metadata.get("completed_at")
    if text:
        try:
            at = dt.datetime.fromisoformat(text)
            return at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)
        except ValueError:
            pass  # a hand-made marker: its update time is as good
    return entry.updated


#: The fleet has changed size when the machines up now differ from the recent average by at least
#: this share of it, and by one machine at least: the ETA then scales the recent rate to the fleet now up.
FLEET_CHANGE = 0.1
#: Below this average the machine records cannot account for the recent completions (local
#: workers, a fleet that has just started): the rate is left as measured.
MIN_RECENT_WORKERS = 0.5


#: The measured rate's ETA and the fleet's waves this many times apart or more get a word on why.
ETA_GAP = 2.0


def with_fleet_size(view: dict, workers_up: int | None, workers_recent: float | None = None) -> dict:
    """Add the fleet's side of the ETA to `view`.

    The headline ETA (`eta_s`) is always the measured rate's: the recent completions count
    everything a task costs (claims, model loads, uploads, the time between tasks) and every
    worker, whether it writes a machine record or not. The recent rate was measured while
    `workers_recent` machines worked on average (since `rate_since`). When the machines up now
    (`workers_up`) differ from that (reporting.machinestate: preempted, lost or new machines), the
    rate is scaled to the fleet now up, so the headline ETA and its range are those of this fleet;
    `fleet_changed` says so, with the ETA the old rate gave.

    Beside it, `eta_fleet_s`: with W machines up and R tasks remaining, ceil(R / W) waves of the
    median task, back to back, which is as fast as those machines can go; the ETA's range is
    widened to hold it. When the two are ETA_GAP times apart or more, `eta_gap` says by how much
    and what makes a measured rate slower or faster than the machines up running tasks back to
    back (`eta_gap_text`). With no machine up and tasks remaining nothing will finish: the ETA is
    then unknown (None). `workers_up` None (no machine records, e.g. local workers) leaves the view
    as it is."""
    remaining = view["total"] - view["done"] - view["failed"]
    view["workers_up"] = workers_up
    view["workers_recent"] = workers_recent
    view["eta_fleet_s"] = None
    view["fleet_changed"] = None
    view["eta_gap"] = None
    if workers_up is None or remaining <= 0:
        return view
    if workers_up == 0:
        view["eta_s"] = view["eta_range_s"] = None
        return view
    if (workers_recent is not None and workers_recent >= MIN_RECENT_WORKERS and view["eta_s"]
            and abs(workers_up - workers_recent) >= max(1.0, FLEET_CHANGE * workers_recent)):  # fmt: skip
        factor = workers_recent / workers_up  # an ETA is inversely proportional to the rate
        view["fleet_changed"] = {"from": workers_recent, "to": workers_up, "eta_at_recent_rate_s": view["eta_s"]}
        view["eta_s"] = round(view["eta_s"] * factor, 1)
        if view["eta_range_s"] is not None:
            view["eta_range_s"] = [None if e is None else round(e * factor, 1) for e in view["eta_range_s"]]
    if view["median_task_s"] is not None:
        fleet_eta = round(math.ceil(remaining / workers_up) * view["median_task_s"], 1)
        view["eta_fleet_s"] = fleet_eta
        span = view["eta_range_s"]
        if span is not None:
            high = None if span[1] is None else max(span[1], fleet_eta)
            view["eta_range_s"] = [min(span[0], fleet_eta), high]
        eta = view["eta_s"]
        if eta and fleet_eta and max(eta / fleet_eta, fleet_eta / eta) >= ETA_GAP:
            view["eta_gap"] = {"ratio": round(max(eta / fleet_eta, fleet_eta / eta), 1),
                               "rate_is": "slower" if eta > fleet_eta else "faster"}  # fmt: skip
    return view


def eta_gap_text(view: dict) -> str | None:
    """Why the measured rate's ETA and the fleet's waves are far apart, and which to go by (the rate's)."""
    gap = view.get("eta_gap")
    if not gap:
        return None
    if gap["rate_is"] == "slower":
        return (f"the measured rate is {gap['ratio']:g}x slower than that: time between tasks (claims, model loads, "
                "uploads) or machines up that take no task; the ETA goes by the measured rate")  # fmt: skip
    return (f"the measured rate is {gap['ratio']:g}x faster than that: workers without a machine record (local ones), "
            "recent tasks shorter than the median, or tasks under way (counted whole) nearly done; the ETA goes by "
            "the measured rate")  # fmt: skip


def _eta_range(remaining: int, rate_low: float | None, rate_high: float | None) -> list[float | None] | None:
    """[soonest, latest] seconds to finish at the recent rate's bounds; latest is None (unbounded)
    when so few tasks finished that the rate may be zero."""
    if not remaining:
        return [0.0, 0.0]
    if not rate_high:
        return None
    return [round(remaining / rate_high, 1), round(remaining / rate_low, 1) if rate_low else None]


def _curve(
    times: list[dt.datetime], swept_times: list[dt.datetime], now: dt.datetime, scale: float, before: int
) -> dict | None:
    """Done tasks over time, at CURVE_POINTS evenly spaced times from the first listed completion to
    now; open regions' counts are scaled like the totals. Swept regions' markers not listed count
    from the start: `before`, the curve's floor."""
    if not times and not swept_times:
        return None
    start = min(times[:1] + swept_times[:1])
    step = max((now - start).total_seconds(), 1.0) / (CURVE_POINTS - 1)
    points = []
    for k in range(CURVE_POINTS):
        at = start + dt.timedelta(seconds=k * step)
        count = bisect.bisect_right(times, at) * scale + bisect.bisect_right(swept_times, at)
        points.append([round(k * step, 1), round(before + count)])
    return {"start": start.isoformat(timespec="seconds"), "floor": before, "points": points}


def _reasons(store: ObjectStore, failed: list[str]) -> dict[str, dict[str, str | None]]:
    """`failed_reasons` and `failed_details` (the first line of the precise message) of up to
    MAX_REASONS dead letters, one read each."""
    reasons, details = {}, {}
    for task_id in failed:
        try:
            letter = json.loads(store.read(layout.failed_object(task_id)).data)
            reasons[task_id], details[task_id] = str(letter.get("reason", "?")), first_line(letter)
        except (StoreError, ValueError) as exc:
            reasons[task_id], details[task_id] = f"(unreadable dead letter: {exc})", None
    return {"failed_reasons": reasons, "failed_details": details}


#: What both views say of a dead letter read without a precise message.
NO_MESSAGE = "(no message)"


def detail_text(view: dict, task_id: str) -> str:
    """The first line of a dead letter read, as the text view and the page both show it."""
    return view["failed_details"].get(task_id) or NO_MESSAGE


def first_line(letter: dict) -> str | None:
    """The first line of a dead letter's precise message: its `message` when it has one; else, from
    the last attempt's output tail, the consumer's `event=bad_input` log line (its `error=` part:
    file, row, sample id, reason) or else the tail's last line (a traceback ends with the error)."""
    if letter.get("message"):
        return str(letter["message"]).strip().splitlines()[0][:500]
    errors = letter.get("errors") or []
    tail = str(errors[-1].get("error", "")) if errors and isinstance(errors[-1], dict) else ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if "event=bad_input" in line and "error=" in line:
            return line.split("error=", 1)[1][:500]
    return lines[-1][:500] if lines else None


#: Lines or items of one kind in the default text view; `full` lifts the caps.
TEXT_ITEMS = 10
#: Characters of the holders line in the default text view.
HOLDERS_CHARS = 160


def render(view: dict, full: bool = False) -> str:
    """The text view. It fits a screen at any queue size: holders, stale leases and dead letters
    are capped (TEXT_ITEMS, HOLDERS_CHARS), saying how many more there are; `full` lists all."""
    total = view["total"] or 1
    approx = "~" if view["estimate"] else ""
    lines = [
        f"queue   {view['queue']}",
        f"tasks   {approx}{view['total']} total: {view['done']} done ({100 * view['done'] / total:.1f}%), "
        f"{view['pending']} pending, {view['leased']} leased, {view['stale']} stale, {view['failed']} failed",
    ]
    if view["tasks_per_s"] and not view["complete"]:  # a finished queue has no rate to fall nor an ETA
        lines.append(eta_text(view))
    counted = reported_counters(view)
    if counted:
        lines.append("counted " + ", ".join(f"{name}={n}" for name, n in counted.items()))
    if view["holders"]:
        lines.append(holders_text(view, None if full else HOLDERS_CHARS))
    stale = view["stale_leases"] if full else view["stale_leases"][:TEXT_ITEMS]
    for lease in stale:
        lines.append(f"stale   {lease['task']} held by {lease['worker']}, silent {lease['silent_s']:.0f}s")
    if len(stale) < len(view["stale_leases"]):
        lines.append(f"stale   ... {len(view['stale_leases']) - len(stale)} more (--machines lists them all)")
    lines += dead_letter_lines(view, None if full else TEXT_ITEMS)
    lines += render_blockers(view, None if full else TEXT_ITEMS)
    if view["complete"]:
        lines.append(finished_text(view))
    regions = view["regions"]
    how = (
        f"ESTIMATE from {regions['listed']} of {regions['open']} open regions"
        if view["estimate"]
        else f"exact, {regions['listed']} open regions listed"
    )
    lines.append(f"cost    {view['requests']} requests ({how}; {regions['swept']} of {regions['total']} regions swept)")
    return "\n".join(lines)


def finished_text(view: dict) -> str:
    """What a complete queue says: a clean finish, or one whose outputs miss its dead letters (the
    keeper and the workers stop on either: nothing is left to run; `down` asks on the second)."""
    if not view["failed"]:
        return "complete: every task has a done or failed marker"
    return (f"finished: {view['done']} done, {view['failed']} dead letter{'s' if view['failed'] != 1 else ''}: the job's "
            f"outputs miss {'them' if view['failed'] != 1 else 'it'}; `tools/status.py {view['queue']} --machines` "
            f"lists every one with its reason (fix the cause, submit again under new ids)")  # fmt: skip


def reported_counters(view: dict) -> dict[str, int]:
    """The counters worth a word: those above zero (a counter at 0, e.g. no row skipped, says nothing)."""
    return {name: n for name, n in (view.get("counters") or {}).items() if n}


def eta_text(view: dict) -> str:
    """The rate and ETA lines: the measured rate's ETA and its range; then the machines up running the
    median task back to back, and why the two differ when they are far apart; and when the ETA is that
    of a fleet other than the one the rate was measured with, so."""
    eta, span = view["eta_s"], view.get("eta_range_s")
    between = f" ({duration_text(span[0])} to {duration_text(span[1])})" if span else ""
    text = (f"rate    {view['tasks_per_s'] * 60:.1f} tasks/min over the last {view['recent_done']} done, "
            f"eta {duration_text(eta) if eta is not None else '?'}{between} at that rate")  # fmt: skip
    changed = view.get("fleet_changed")
    if changed:
        text += (f"\n        at the {changed['to']} machines up now; the rate was measured with {changed['from']:g} "
                 f"on average (at that rate: {duration_text(changed['eta_at_recent_rate_s'])})")  # fmt: skip
    if view.get("eta_fleet_s") is not None:
        text += (f"\n        the {view['workers_up']} machines up running the {duration_text(view['median_task_s'])} median "
                 f"task back to back: {duration_text(view['eta_fleet_s'])}")  # fmt: skip
        why = eta_gap_text(view)
        if why:
            text += f"\n        {why}"
    return text


def holders_text(view: dict, max_chars: int | None) -> str:
    """`holders W workers hold L leases: a=3, b=2, ... (+N more)`, at most `max_chars` long (None: all)."""
    hosts = view.get("slice_hosts", {})
    items = [f"{w} ({hosts[w]} hosts)={n}" if w in hosts else f"{w}={n}" for w, n in view["holders"].items()]
    head = f"holders {len(items)} workers hold {sum(view['holders'].values())} leases: "
    text, shown = head, 0
    for item in items:
        rest = len(items) - shown - 1
        tail = f" (+{rest} more, --machines lists all)" if rest else ""
        if max_chars is not None and len(text) + len(item) + 2 + len(tail) > max_chars and shown:
            return text + f" (+{len(items) - shown} more, --machines lists all)"
        text += (", " if shown else "") + item
        shown += 1
    return text


def dead_letter_groups(view: dict) -> tuple[list[tuple[str, int, list[str]]], int]:
    """Dead letters grouped by reason: [(reason, count, [tasks read with it])], most first, and how
    many have a reason neither listed nor read. Counts come from the listing (`failed_by_reason`);
    dead letters older than that metadata are counted from the MAX_REASONS read."""
    counts = dict(view.get("failed_by_reason") or {})
    read: dict[str, list[str]] = {}
    for task_id, reason in view["failed_reasons"].items():
        read.setdefault(reason, []).append(task_id)
    for reason, tasks in read.items():
        counts.setdefault(reason, 0)
        counts[reason] = max(counts[reason], len(tasks))
    groups = sorted(((r, n, read.get(r, [])) for r, n in counts.items()), key=lambda g: (-g[1], g[0]))
    return groups, max(0, view["failed"] - sum(counts.values()))


def dead_letter_lines(view: dict, max_groups: int | None) -> list[str]:
    """`failed  x100 consumer exit 65: bad input | t7: <its first line>`, a line per reason."""
    groups, unknown = dead_letter_groups(view)
    lines = []
    for reason, count, tasks in groups if max_groups is None else groups[:max_groups]:
        example = f" | {tasks[0]}: {detail_text(view, tasks[0])}" if tasks else ""
        lines.append(f"failed  x{count} {reason}{example}")
    if max_groups is not None and len(groups) > max_groups:
        lines.append(f"failed  ... {len(groups) - max_groups} more reasons (--machines lists them all)")
    if unknown:
        lines.append(f"failed  x{unknown} reason not read (older dead letters; {MAX_REASONS} are read per view)")
    return lines


def duration_text(seconds: float | None) -> str:
    """`1h05m`, `4m10s`, `45s`, `0.4s`; None is an unbounded span."""
    if seconds is None:
        return "unbounded"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
