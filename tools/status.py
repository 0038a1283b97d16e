#!/usr/bin/env python3
"""Progress of a queue from its listings: `status.py QUEUE [--json] [--watch [SECONDS]]`."""

import argparse
import json
import sys
import time

from fleet.machines import fleet_snapshot, render_fleet
from objectstore import open_store
from taskqueue.status import render, snapshot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("queue", help="gs://bucket/prefix or a local directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--watch", nargs="?", type=float, const=10.0, default=None, metavar="SECONDS", help="refresh view")
    args = p.parse_args()
    store = open_store(args.queue)
    while True:
        view = snapshot(store)
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
