"""What `tools/status.py` costs on a big queue: requests and time for the text/JSON view and the page.

    python -m bench.status_bench [--tasks 100000] [--machines 1000] [--swept 0.5]

The queue lives in tests/simworld's SimStore (GCS's listing pages of 1000, in name order, with
start/end offsets), filled directly: `--tasks` tasks in regions of 1000 (a split per region), the
first `--swept` of the regions finished and swept, the rest half done, a lease on every unfinished
task of the open regions held by one of `--machines` machines, a machine record per machine (with
the cost fields; a few failed, silent, lost or straggling), and one dead letter per 1000 tasks. It then times
`tools/status.py`'s view (as --json prints it), the same with --history (the page's completion curve lists swept
regions' done markers too), the text view's size (lines by default and with --machines), and the page's rendering.
It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time

from tests.simworld.scheduler import EPOCH, Scheduler
from tests.simworld.store import Limits, SimStore
from fleet import machines
from reporting.pricing import load_prices
from taskqueue import layout
from tools.status import job_view, render_text


def build(tasks: int, n_machines: int, swept_share: float) -> SimStore:
    store = SimStore(Scheduler(), Limits(), seed=1)
    now = EPOCH + dt.timedelta(hours=6)
    ids = [f"t{k:07d}" for k in range(tasks)]
    regions = [ids[i : i + layout.REGION_TASKS] for i in range(0, tasks, layout.REGION_TASKS)]
    n_swept = int(len(regions) * swept_share)
    for r, region in enumerate(regions):
        if r:
            store._store(layout.split_object(region[0]), b"{}", None)
        end = regions[r + 1][0] if r + 1 < len(regions) else None
        for k, task_id in enumerate(region):
            store._store(layout.task_object(task_id), b"{}", {"manifest": "{}"})
            done = r < n_swept or k % 2 == 0
            holder = f"vm-{(r * layout.REGION_TASKS + k) % n_machines:04d}"
            if k % 1000 == 7:
                reason = "consumer exit 65: bad input"  # listed too, as taskqueue.lease.marker_of writes it
                store._store(layout.failed_object(task_id), json.dumps({"reason": reason}).encode(), {"reason": reason})
                store._store(layout.lease_object(task_id), b"{}", {"state": "dead", "worker": holder, "ttl_s": "120"})
            elif done:
                at = now - dt.timedelta(seconds=(tasks - r * layout.REGION_TASKS - k) * 0.2)
                meta = {"completed_at": at.isoformat(timespec="seconds"), "seconds": "60.0"}
                store._store(layout.done_object(task_id), b"{}", meta)
                store._store(layout.lease_object(task_id), b"{}", {"state": "done", "worker": holder, "ttl_s": "120"})
            elif k % 4 == 1:
                meta = {"state": "held", "worker": holder, "ttl_s": "1e9", "heartbeat_at": now.isoformat()}
                store._store(layout.lease_object(task_id), b"{}", meta)
        if r < n_swept:
            failed = sum(1 for k in range(len(region)) if k % 1000 == 7)
            meta = {"end": end or "", "tasks": str(len(region)), "failed": str(failed), "confirmed": "1"}
            store._store(layout.swept_object(region[0] if r else layout.HEAD), b"{}", meta)
    for m in range(n_machines):
        # Most machines work; 1 in 100 failed its boot, 1 in 200 is silent (missed a beat), 1 in 200
        # lost (silent for 10 minutes) and 1 in 100 a straggler (on one task for an hour).
        state, at, since, fields = "working", now, now - dt.timedelta(seconds=30), {"task": f"t{m:07d}"}
        if m % 100 == 3:
            state, fields = "failed", {"reason": "install_failed: exit 1 at line 300",
                                       "log_tail": "ERROR: No matching distribution found for jax[tpu]\n" * 5}  # fmt: skip
        elif m % 200 == 5:
            at = now - dt.timedelta(seconds=120)
        elif m % 200 == 7:
            at = now - dt.timedelta(seconds=600)
        elif m % 100 == 11:
            since = now - dt.timedelta(hours=1)
        body = machines.make_record(f"vm-{m:04d}", state, at=at, since=since.isoformat(), beat_s=60.0,
                                    spent={"booting": 60, "installing": 240, "working": 20000, "idle": 30},
                                    machine_type="v5litepod-8", provisioning="spot", **fields)  # fmt: skip
        store._store(machines.record_object(body["machine"]), json.dumps(body).encode(), machines.listed_metadata(body))
    return store


def measure(store: SimStore, history: bool, now: dt.datetime) -> tuple[dict, float]:
    started = time.perf_counter()
    view = job_view(store, load_prices(), now, None, None, history=history)
    return view, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=100_000)
    p.add_argument("--machines", type=int, default=1000)
    p.add_argument("--swept", type=float, default=0.5, help="share of regions finished and swept")
    args = p.parse_args()
    started = time.perf_counter()
    store = build(args.tasks, args.machines, args.swept)
    print(f"queue: {args.tasks:,} tasks, {args.machines:,} machines, {len(store):,} objects "
          f"(built in {time.perf_counter() - started:.1f}s)")  # fmt: skip
    now = EPOCH + dt.timedelta(hours=6)
    latency_ms = Limits().latency_s * 1000
    for history in (False, True):
        view, seconds = measure(store, history, now)
        label = "status --json --history (the page's view)" if history else "status --json"
        print(f"{label}: {view['requests']} requests, {seconds:.2f}s in this process "
              f"(+ ~{view['requests'] * latency_ms / 1000:.1f}s of {latency_ms:.0f} ms round trips, one at a time)")
        print("  by kind: " + ", ".join(f"{k}={n}" for k, n in sorted(view["requests_by_kind"].items())))
        print(f"  done {view['done']:,}/{view['total']:,}, eta {view['eta_s']}s {view['eta_range_s']}, "
              f"cost ${view['fleet']['cost']['total_dollars']:,.2f}, waste ${view['fleet']['cost']['waste_dollars']:,.2f}")
        if not history:
            text, everything = render_text(view).splitlines(), render_text(view, all_machines=True).splitlines()
            print(f"  text view: {len(text)} lines, the longest {max(map(len, text))} characters "
                  f"(--machines: {len(everything):,} lines)")
    from reporting.page import render_html

    started = time.perf_counter()
    page = render_html(view, generated=now).encode()
    print(f"page: {len(page):,} bytes, rendered in {time.perf_counter() - started:.2f}s; publishing it is 1 more request")


if __name__ == "__main__":
    main()
