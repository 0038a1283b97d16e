#!/usr/bin/env python3
"""Progress and cost of a queue from its listings: `status.py QUEUE [--json] [--html FILE] [--publish] [--watch [SECONDS]]`.

Every view states what it cost in requests. Swept regions (about a thousand finished tasks each)
are counted from their markers; `--estimate` lists only a few random open regions and
extrapolates, labelled as an estimate; `--watch` keeps the open regions' task lists between
ticks, so a tick lists only their done and failed markers and the leases.

The fleet section (one listing of machines/) adds the cost so far, priced from reporting/prices.json
(`--prices` for another copy), the waste, and the projected cost to finish. The text view fits a
screen at any fleet size: counts by state and type, and only the machines that need attention
(silent, lost, failed, stragglers); `--machines` lists every machine and holder. `--html FILE` writes a
self-contained status page; `--publish` writes it to the queue as `status.html` (text/html), and
with `--watch` refreshes it every tick. `--now` computes the view as of another time (UTC, ISO 8601).
"""

import argparse
import datetime as dt
import json
import pathlib
import sys
import time

from reporting.cost import render_cost, to_finish
from reporting.fleetview import fleet_snapshot, render_fleet
from reporting.goodput import render_goodput, with_cost
from reporting.pricing import PriceError, load_prices
from objectstore import StoreError, open_store
from objectstore.counting import CountingStore
from reporting.status import RegionCache, render, snapshot, with_fleet_size

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("queue", help="gs://bucket/prefix or a local directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--estimate", nargs="?", type=int, const=8, default=None, metavar="REGIONS",
                   help="list only this many random open regions (default 8) and extrapolate")
    p.add_argument("--watch", nargs="?", type=float, const=10.0, default=None, metavar="SECONDS", help="refresh view")
    p.add_argument("--html", metavar="FILE", help="also write the status page to FILE")
    p.add_argument("--publish", action="store_true", help="also write the status page to the queue as status.html")
    p.add_argument("--prices", metavar="FILE", help="price table (default: reporting/prices.json)")
    p.add_argument("--history", action="store_true",
                   help="list swept regions' done markers too, for the completion curve (as --html does)")
    p.add_argument("--now", metavar="TIME", help="compute the view as of this UTC time (ISO 8601), e.g. for a report")
    p.add_argument("--machines", action="store_true",
                   help="list every machine, holder, stale lease and failure reason (the default view is capped at a screen)")
    args = p.parse_args(argv)
    if args.estimate is not None and args.estimate < 1:
        p.error(f"--estimate must list at least 1 region, got {args.estimate}")
    now = None
    if args.now:
        try:
            now = dt.datetime.fromisoformat(args.now)
        except ValueError:
            p.error(f"--now {args.now!r} is not an ISO 8601 time; write e.g. 2026-11-23T15:00:00+00:00")
        now = now if now.tzinfo else now.replace(tzinfo=dt.timezone.utc)
    try:
        prices = load_prices(args.prices)
    except PriceError as exc:
        p.error(str(exc))
    store = open_store(args.queue)
    cache = RegionCache() if args.watch else None
    while True:
        at = now or dt.datetime.now(dt.timezone.utc)
        view = job_view(store, prices, at, args.estimate, cache, history=bool(args.html or args.publish or args.history))
        if args.html or args.publish:
            from reporting.page import render_html

            page = render_html(view, generated=at).encode()
            if args.html:
                pathlib.Path(args.html).write_bytes(page)
            if args.publish:
                try:
                    store.put(PAGE_OBJECT, page, content_type="text/html; charset=utf-8")
                except StoreError as exc:
                    print(f"status: could not publish {store.url(PAGE_OBJECT)}: {exc}", file=sys.stderr)
                    if not args.watch:
                        return 1
        text = json.dumps(view, indent=1) if args.json else render_text(view, all_machines=args.machines)
        if args.watch and sys.stdout.isatty():
            print("\033[H\033[2J", end="")
        print(text, flush=True)
        if not args.watch or view["complete"]:
            return 0
        time.sleep(args.watch)


if __name__ == "__main__":
    sys.exit(main())
