"""The fleet section of status: one listing of `machines/`, each record classified once
(reporting/machinestate.py), and from that one classification the counts by condition and by type,
the machines that need a person (silent, lost, failed, stragglers), the machines up for the ETA,
the fleet's average size while the recent completion rate was measured, and the cost
(reporting/cost.py). Its text rendering fits a screen at any fleet size; `all_machines` lists every one.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
from collections.abc import Mapping

from reporting.cost import fleet_cost
from fleet.machines import DEFAULT_BEAT_S, PREFIX, deletion_notes, record_object
from reporting.machinestate import (
    BOOT_STUCK_S,
    CONDITIONS,
    DELETING_GONE_S,
    LOST_AFTER_BEATS,
    SILENT_AFTER_BEATS,
    UP,
    classify,
    counted_until,
    is_worker,
    read_row,
    worker_seconds_between,
)
from objectstore import ObjectStore, StoreError

#: A working machine whose task has run this many times the median task's seconds is a straggler.
STRAGGLER_FACTOR = 3.0
#: Failed records read (one GET each, the most recent first) for the log tail their body carries.
MAX_LOG_TAILS = 20
#: Lines of machines that need attention in the default text view (`all_machines` lifts it).
ATTENTION_LINES = 15
#: Failure reasons shown in the default text view.
REASON_LINES = 5
#: The order of attention: the likeliest to be costing money for nothing first.
_SEVERITY = {"lost": 0, "silent": 1, "straggler": 2, "failed": 3}


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def fleet_snapshot(
    store: ObjectStore,
    now: dt.datetime | None = None,
    prices=None,
    median_task_s: float | None = None,
    rate_since: dt.datetime | None = None,
) -> dict:
    """The fleet from one listing of `machines/` (plus up to MAX_LOG_TAILS reads of failed records).

    Counts are of workers: a VM, or a TPU slice by its worker 0's record; a slice's other hosts'
    records show only when they failed. `workers_up` is how many are up now; `workers_recent` the
    average number working or idle since `rate_since` (when the recent completion rate began), so
    the ETA can scale the rate to the fleet now up. With `prices` (a reporting.pricing.PriceTable),
    `cost` is what the fleet has cost so far (reporting/cost.py)."""
    now = now or _now()
    rows = sorted((read_row(e, now) for e in store.list(PREFIX) if e.name.endswith(".json")), key=lambda r: r["machine"])
    notes = deletion_notes(store) if rows else {}
    for row in rows:
        _ended_by_note(row, notes.get(row["machine"]), now)
        row["condition"] = classify(row)
    workers = [r for r in rows if is_worker(r)]
    by_state = collections.Counter(r["condition"] for r in workers)
    by_type: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in workers:
        by_type[(r["machine_type"] or "unknown", r["provisioning"] or "standard")][r["condition"]] += 1
    failed = [r for r in rows if r["condition"] == "failed"]
    failures: dict[str, list[str]] = collections.defaultdict(list)
    for r in failed:
        failures[r["reason"] or "unknown"].append(r["machine"])
    attention, stragglers = [], []
    for r in workers:
        condition = r["condition"]
        if condition in ("silent", "lost"):
            attention.append(_attention(r, condition, r["age_s"], r["task"] if r["state"] == "working" else None))
        elif condition == "working" and median_task_s and r["since"] is not None:
            held_s = (counted_until(r, now) - r["since"]).total_seconds()
            if held_s > STRAGGLER_FACTOR * median_task_s:
                stragglers.append({"machine": r["machine"], "task": r["task"], "held_s": round(held_s, 1),
                                   "median_task_s": round(median_task_s, 1)})  # fmt: skip
                attention.append(_attention(r, "straggler", held_s, r["task"]))
    attention += [_attention(r, "failed", r["age_s"], None) for r in failed]
    attention.sort(key=lambda a: (_SEVERITY[a["condition"]], a["machine"]))
    workers_recent = None
    if rate_since is not None and rate_since < now:
        span = (now - rate_since).total_seconds()
        workers_recent = round(sum(worker_seconds_between(r, rate_since, now) for r in workers) / span, 2)
    view = {
        "machines": len(workers),
        "other_hosts": len(rows) - len(workers),
        "by_state": {c: by_state[c] for c in CONDITIONS if by_state[c]},
        "by_type": [{"machine_type": t, "provisioning": p, "machines": sum(n.values()),
                     "by_state": {c: n[c] for c in CONDITIONS if n[c]}} for (t, p), n in sorted(by_type.items())],  # fmt: skip
        "workers_up": sum(by_state[c] for c in UP),
        "workers_recent": workers_recent,
        "failures": {reason: names for reason, names in sorted(failures.items())},
        "log_tails": _log_tails(store, failed),
        "attention": attention,
        "silent": [r["machine"] for r in workers if r["condition"] == "silent"],
        "lost": [r["machine"] for r in workers if r["condition"] == "lost"],
        "silent_after_s": SILENT_AFTER_BEATS * DEFAULT_BEAT_S,
        "lost_after_s": LOST_AFTER_BEATS * DEFAULT_BEAT_S,
        "boot_lost_after_s": BOOT_STUCK_S,
        "deleting_gone_s": DELETING_GONE_S,
        # Every worker, for `--machines` and the page's full list.
        "roster": [{"machine": r["machine"], "condition": r["condition"], "task": r["task"] if r["state"] == "working" else None,
                    "machine_type": r["machine_type"], "provisioning": r["provisioning"], "age_s": r["age_s"]}
                   for r in workers],  # fmt: skip
        "stragglers": stragglers,
    }
    if prices is not None:
        view["cost"] = fleet_cost(rows, prices, now)
    return view


def _ended_by_note(row: dict, note: dict | None, now: dt.datetime) -> None:
    """A machine deleted by `down` or `keep` after its last record (fleet/machines.py, deletion notes) ended there:
    its row reads `exited` at the note's time, with the note's reason, so it is neither up nor billed after."""
    if note is None or note["at"] is None or row["state"] in ("failed", "exited"):
        return
    if row["at"] is not None and row["at"] > note["at"]:
        return  # a record written after the note: a new machine under the same name
    row.update(state="exited", reason=f"deleted by {note['by']}: {note['reason']}", at=note["at"],
               age_s=round(max(0.0, (now - note["at"]).total_seconds()), 1))


def _attention(row: Mapping, condition: str, for_s: float, task: str | None) -> dict:
    return {"machine": row["machine"], "condition": condition, "state": row["state"], "for_s": round(for_s, 1),
            "task": task, "reason": row["reason"] if condition == "failed" else None,
            "machine_type": row["machine_type"]}  # fmt: skip


def _log_tails(store: ObjectStore, failed: list[dict]) -> dict[str, str]:
    """The `log_tail` of up to MAX_LOG_TAILS failed records, the most recent first (one read each);
    the listing leaves it out, it is too long for metadata."""
    tails = {}
    for row in sorted(failed, key=lambda r: r["age_s"])[:MAX_LOG_TAILS]:
        try:
            body = json.loads(store.read(record_object(row["machine"])).data)
        except (StoreError, ValueError) as exc:
            tails[row["machine"]] = f"(record unreadable: {exc})"
            continue
        if isinstance(body, dict) and body.get("log_tail"):
            tails[row["machine"]] = str(body["log_tail"])
    return tails


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def condition_counts(by_state: Mapping[str, int]) -> str:
    """`up 7 (working 5, idle 2), silent 1, failed 2`: the conditions in CONDITIONS order."""
    up = [f"{c} {by_state[c]}" for c in UP if by_state.get(c)]
    rest = [f"{c} {n}" for c, n in by_state.items() if c not in UP]
    head = [f"up {sum(by_state.get(c, 0) for c in UP)}" + (f" ({', '.join(up)})" if up else "")]
    return ", ".join(head + rest)


def attention_line(a: Mapping) -> str:
    """One machine that needs attention, as the text view and the page's table say it."""
    if a["condition"] == "failed":
        return f"failed {_duration(a['for_s'])} ago: {a['reason'] or 'no reason recorded'}"
    if a["condition"] == "straggler":
        return f"on {a['task']} for {_duration(a['for_s'])}"
    doing = f"{a['state']} {a['task']}" if a.get("task") else a["state"]
    return f"last record {_duration(a['for_s'])} ago ({doing})"


def render_fleet(view: Mapping, all_machines: bool = False) -> list[str]:
    """The text view's fleet lines: the counts by condition and by type, failures by reason, and
    the machines that need attention, capped at ATTENTION_LINES (all of them with `all_machines`,
    and then every machine's line too)."""
    if not view["machines"] and not view["failures"]:
        return ["fleet   no machine records yet (machines/ is empty)"]
    lines = [f"fleet   {view['machines']} machines: {condition_counts(view['by_state'])}"]
    for group in view["by_type"]:
        lines.append(f"  {group['machine_type']} {group['provisioning']} x{group['machines']}: "
                     f"{condition_counts(group['by_state'])}")  # fmt: skip
    reasons = list(view["failures"].items())
    shown = reasons if all_machines else reasons[:REASON_LINES]
    for reason, names in shown:
        listed = ", ".join(names[:5]) + (f" (+{len(names) - 5})" if len(names) > 5 else "")
        lines.append(f"  failed x{len(names)}: {reason}  [{listed}]")
    if len(shown) < len(reasons):
        lines.append(f"  ... {len(reasons) - len(shown)} more failure reasons (--machines lists them all)")
    attention = view["attention"]
    if attention:
        kinds = collections.Counter(a["condition"] for a in attention)
        summary = ", ".join(f"{k} {kinds[k]}" for k in _SEVERITY if kinds[k])
        shown_a = attention if all_machines else attention[:ATTENTION_LINES]
        more = "" if len(shown_a) == len(attention) else f"; the first {len(shown_a)} shown, --machines lists all"
        lines.append(f"attention {len(attention)} machines ({summary}{more})")
        width = max(len(a["machine"]) for a in shown_a)
        lines += [f"  {a['machine']:<{width}}  {a['condition']:<9} {attention_line(a)}" for a in shown_a]
    if all_machines and view["roster"]:
        lines.append(f"machines {len(view['roster'])} (a TPU slice counts once)")
        width = max(len(m["machine"]) for m in view["roster"])
        for m in view["roster"]:
            what = f" {m['task']}" if m["task"] else ""
            lines.append(f"  {m['machine']:<{width}}  {m['condition']:<10} {m['machine_type'] or '?'} {m['provisioning'] or ''}"
                         f"{what}, last record {_duration(m['age_s'])} ago")  # fmt: skip
    return lines
