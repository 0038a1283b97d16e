#!/usr/bin/env python3
"""Progress of a queue from its listings: `status.py QUEUE [--json] [--estimate [REGIONS]] [--watch [SECONDS]]`.

Every view states what it cost in requests. Swept regions (about a thousand finished tasks each)
are counted from their markers; `--estimate` lists only a few random open regions and
extrapolates, labelled as an estimate; `--watch` keeps the open regions' task lists between
ticks, so a tick lists only their done and failed markers and the leases.
"""

import argparse
import json
import sys
import time

from fleet.machines import fleet_snapshot, render_fleet
from objectstore import open_store
from taskqueue.status import RegionCache, render, snapshot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("queue", help="gs://bucket/prefix or a local directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--estimate", nargs="?", type=int, const=8, default=None, metavar="REGIONS",
                   help="list only this many random open regions (default 8) and extrapolate")
    p.add_argument("--watch", nargs="?", type=float, const=10.0, default=None, metavar="SECONDS", help="refresh view")
    args = p.parse_args()
    if args.estimate is not None and args.estimate < 1:
        p.error(f"--estimate must list at least 1 region, got {args.estimate}")
    store = open_store(args.queue)
    cache = RegionCache() if args.watch else None
    while True:
        view = snapshot(store, sample=args.estimate, cache=cache)
        fleet = fleet_snapshot(store)  # one listing of machines/ (docs/PROTOCOL.md, "Machine records")
        text = json.dumps({**view, "fleet": fleet}, indent=1) if args.json else render(view) + "\n" + render_fleet(fleet)
        if args.watch and sys.stdout.isatty():
            print("\033[H\033[2J", end="")
        print(text, flush=True)
        if not args.watch or view["complete"]:
            return 0
        time.sleep(args.watch)


if __name__ == "__main__":
    sys.exit(main())
