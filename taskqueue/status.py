"""Progress of a queue from its listings: counts, holders, stale leases, throughput, ETA, dead letters."""

from __future__ import annotations

import collections
import datetime as dt
import json

from objectstore import ObjectStore, StoreError
from taskqueue import layout
from taskqueue.lease import DEAD, HELD, RELEASED

RATE_WINDOW_S = 600.0  # throughput is measured over the last ten minutes of done markers
MAX_REASONS = 20


def snapshot(store: ObjectStore, now: dt.datetime | None = None) -> dict:
    """A JSON-ready summary. Staleness uses the store's own update times, never a worker's clock."""
    now = now or dt.datetime.now(dt.timezone.utc)
    tasks = {layout.id_from_object(e.name, layout.TASKS) for e in store.list(layout.TASKS)} - {None}
    done_times = {}
    for entry in store.list(layout.DONE):
        task_id = layout.id_from_object(entry.name, layout.DONE)
        if task_id:
            done_times[task_id] = entry.updated
    failed = [layout.id_from_object(e.name, layout.FAILED) for e in store.list(layout.FAILED)]
    failed = sorted(t for t in failed if t)
    leased, stale, released = [], [], []
    holders: collections.Counter[str] = collections.Counter()
    for entry in store.list(layout.LEASES):
        task_id = layout.id_from_object(entry.name, layout.LEASES)
        state = entry.metadata.get("state", HELD)
        if not task_id or task_id in done_times or state == DEAD:
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
    # A slice is one claimant: its leader holds the leases; its assignment says how many hosts it has.
    slice_hosts = {e.metadata["leader"]: int(e.metadata["hosts"]) for e in store.list("slices/")
                   if e.metadata.get("leader") in holders and e.metadata.get("hosts", "").isdigit()}  # fmt: skip
    finished = set(done_times) | set(failed)
    total = len(tasks | finished)
    pending = total - len(done_times) - len(failed) - len(leased) - len(stale)
    recent = [t for t in done_times.values() if (now - t).total_seconds() <= RATE_WINDOW_S]
    rate = None
    if len(recent) >= 2:
        span = max((now - min(recent)).total_seconds(), 1.0)
        rate = len(recent) / span
    remaining = total - len(done_times) - len(failed)
    return {
        "queue": store.root_url,
        "total": total,
        "pending": pending,
        "leased": len(leased),
        "stale": len(stale),
        "released": len(released),
        "done": len(done_times),
        "failed": len(failed),
        "holders": dict(sorted(holders.items())),
        "slice_hosts": dict(sorted(slice_hosts.items())),
        "stale_leases": sorted(stale, key=lambda s: s["task"]),
        "tasks_per_s": round(rate, 4) if rate else None,
        "eta_s": round(remaining / rate, 1) if rate and remaining else (0.0 if not remaining else None),
        "failed_reasons": _reasons(store, failed[:MAX_REASONS]),
        "complete": total > 0 and remaining == 0,
    }


def _reasons(store: ObjectStore, failed: list[str]) -> dict[str, str]:
    reasons = {}
    for task_id in failed:
        try:
            letter = json.loads(store.read(layout.failed_object(task_id)).data)
            reasons[task_id] = str(letter.get("reason", "?"))
        except (StoreError, ValueError) as exc:
            reasons[task_id] = f"(unreadable dead letter: {exc})"
    return reasons


def render(view: dict) -> str:
    total = view["total"] or 1
    lines = [
        f"queue   {view['queue']}",
        f"tasks   {view['total']} total: {view['done']} done ({100 * view['done'] / total:.1f}%), "
        f"{view['pending']} pending, {view['leased']} leased, {view['stale']} stale, {view['failed']} failed",
    ]
    if view["tasks_per_s"]:
        eta = view["eta_s"]
        lines.append(
            f"rate    {view['tasks_per_s'] * 60:.1f} tasks/min, eta {_duration(eta) if eta is not None else '?'}"
        )
    if view["holders"]:
        hosts = view.get("slice_hosts", {})
        lines.append("holders " + ", ".join(
            f"{w} ({hosts[w]} hosts)={n}" if w in hosts else f"{w}={n}" for w, n in view["holders"].items()
        ))  # fmt: skip
    for stale in view["stale_leases"]:
        lines.append(f"stale   {stale['task']} held by {stale['worker']}, silent {stale['silent_s']:.0f}s")
    for task_id, reason in view["failed_reasons"].items():
        lines.append(f"failed  {task_id}: {reason}")
    if view["complete"]:
        lines.append("complete: every task has a done or failed marker")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
