"""The whole view of a job, as `gcs-spawner status` prints it and the status page draws it: the queue's snapshot
(reporting/status.py), the fleet from its machine records (reporting/fleetview.py), what it has cost and what it
will cost to finish (reporting/cost.py), the goodput (reporting/goodput.py), and the requests it took."""

from __future__ import annotations

import datetime as dt

from objectstore.counting import CountingStore
from reporting.cost import render_cost, to_finish
from reporting.fleetview import fleet_snapshot, render_fleet
from reporting.goodput import render_goodput, with_cost
from reporting.status import RegionCache, render, snapshot, with_fleet_size

#: The status page's object in the queue (`status --publish`).
PAGE_OBJECT = "status.html"


def job_view(store, prices, now: dt.datetime, sample: int | None, cache: RegionCache | None, history: bool = False) -> dict:
    """The queue's snapshot with the fleet (and its cost) and the projected cost to finish; with
    `history`, the completion curve covers swept regions too (the page draws it)."""
    view = snapshot(store, now=now, sample=sample, cache=cache, history=history)
    counted = CountingStore(store)  # the machines/ listing: one request per 1000 records
    rate_since = dt.datetime.fromisoformat(view["rate_since"]) if view.get("rate_since") else None
    fleet = fleet_snapshot(counted, now=now, prices=prices, median_task_s=view["median_task_s"], rate_since=rate_since)
    view["fleet"] = fleet
    if fleet["machines"]:
        with_fleet_size(view, fleet["workers_up"], fleet["workers_recent"])
    else:
        with_fleet_size(view, None)
    view["finish"] = to_finish(fleet["cost"], view["eta_s"], view["eta_range_s"], view["done"])
    view["goodput"] = with_cost(view["goodput"], fleet["cost"] if fleet["machines"] else None)
    view["requests"] += counted.requests
    for kind, n in counted.counts.items():
        view["requests_by_kind"][kind] = view["requests_by_kind"].get(kind, 0) + n
    return view


def render_text(view: dict, all_machines: bool = False) -> str:
    """The text view: a screenful at any fleet size; `all_machines` lists every machine and holder."""
    fleet = view["fleet"]
    cost = render_cost(fleet["cost"], view["finish"]) if fleet["machines"] else []
    return "\n".join([render(view, full=all_machines), *cost, *render_goodput(view["goodput"]),
                      *render_fleet(fleet, all_machines=all_machines)])
