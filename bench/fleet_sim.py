"""A fleet on a virtual clock (tests/simworld/fleet.py): the real claim loop, lease and machine records
against a store that behaves like GCS (tests/simworld/store.py), one actor per worker.

    python -m bench.fleet_sim [--workers 1000] [--tasks 100000] [--mean-task-s 60] [--preempt-per-hour 0]
                              [--faults 0.01] [--late-batch 500]

It reports requests per task by kind (`machines/` for the records), the record writes per task with
the beat rule and as if every change were written, requests and time before each worker's first claim,
claim collisions, makespan against the ideal (total work / workers), the machine time the fleet ran
and how much of it went to tasks, work lost to preemption, the late batches' pickup, a status refresh
while the fleet works, the peak request rate against the bucket's limits, and an extrapolation to a
bigger fleet from a cost model whose terms it prints. For the extrapolation it also runs a companion
fleet of a tenth of the workers and tasks (`--no-companion` skips it), to measure how the per-worker
share grows with the queue. It is a benchmark: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from tests.simworld.fleet import FleetOptions, extrapolate, simulate
from tests.simworld.store import Limits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = FleetOptions()
    for field in dataclasses.fields(FleetOptions):
        p.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                       default=getattr(defaults, field.name))
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--extrapolate", default="10000x1000000", help="WORKERSxTASKS to extrapolate to")
    p.add_argument("--no-companion", action="store_true",
                   help="skip the run at a tenth of the workers and tasks that measures how per-worker requests grow")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for noisy in ("taskqueue", "objectstore"):  # a million event lines would cost more than the run
        logging.getLogger(noisy).setLevel(logging.ERROR)
    options = FleetOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FleetOptions)})
    limits = Limits(latency_s=args.latency_ms / 1000)
    result = simulate(options, limits)
    companion = None
    if not args.no_companion and options.workers >= 10 and options.tasks >= 10:
        small = dataclasses.replace(options, workers=options.workers // 10, tasks=options.tasks // 10)
        companion = simulate(small, limits)
        result["companion"] = {k: companion[k] for k in ("workers", "tasks", "requests_per_task", "wall_seconds")}
    ew, et = (int(x) for x in args.extrapolate.lower().split("x"))
    result["extrapolated"] = extrapolate(result, companion, ew, et)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    r = result
    print(f"fleet  {r['workers']} workers x {r['tasks']} tasks, tasks ~{options.mean_task_s:g}s (lognormal sigma "
          f"{options.task_sigma}), heartbeat {options.heartbeat_s:g}s, preemptions {options.preempt_per_hour:g}/worker-hour, "
          f"faults {options.faults:g} of attempts {r['faults']}, late batches {options.late_batch}; "
          f"simulated in {r['wall_seconds']}s (setup {r['setup_seconds']}s)")
    print(f"done   {r['done']}/{r['tasks']} seen by the workers (status at the end: {r['status']}), double completions {r['double_completions']}, dead letters {r['dead_letters']}, "
          f"exits {r['exit_reasons']}, crashed processes {r['crashes']}")
    print(f"cost   {r['requests_per_task']} requests/task, of which {r['heartbeats_per_task']} heartbeats "
          f"({r['requests_per_task_without_heartbeats']} without them)")
    print("       per task by kind: " + ", ".join(f"{k}={v}" for k, v in r["by_kind_per_task"].items()))
    mw = r["machine_record_writes_per_task"]
    print(f"record machine records {r['machine_record_requests_per_task']} requests/task "
          f"({r['requests_per_task_without_records']} requests/task without them); writes/task: startup.sh "
          f"{mw['startup']}, changes {mw['change']}, beats {mw['beat']}: {mw['total']} "
          f"(every change written at once: {mw['every_change']})")
    fc = r["first_claim_requests"]
    print(f"start  requests before first claim: max {fc['max']}, p50 {fc['p50']}, p99 {fc['p99']} "
          f"(queue; plus machine records: max {r['first_claim_record_requests']['max']}); "
          f"time to first claim: max {r['first_claim_s']['max']}s, p50 {r['first_claim_s']['p50']}s")
    print(f"claims collisions (412 on lease create) {r['claim_collisions']}; all 412s {r['refused_412']}")
    print(f"time   makespan {r['makespan_s']}s vs ideal {r['ideal_s']}s (total work / workers; the fleet boots over "
          f"{options.start_spread_s:g}s): "
          f"{r['makespan_over_ideal']}x (first tasks all done at {r['first_tasks_done_s']}s); machines ran {r['machine_hours']} worker-hours, "
          f"{100 * r['busy_fraction']:.1f}% of it running tasks (the rest: boot spread, moving, waiting at the end)")
    sr = r["status_refresh"]
    if sr:
        print(f"status a refresh while the fleet works ({sr['done']}/{sr['total']} done): {sr['requests']} requests, "
              f"{sr['virtual_s']}s one after another at {args.latency_ms:g} ms each; {sr['by_kind']}")
    for k, batch in enumerate(r["late_batches"]):
        print(f"late   batch {k + 1}: {batch['tasks']} tasks submitted at t={batch['submitted_at_s']}s, waited from "
              f"creation to claim p50 {batch['waited_s']['p50']}s, p99 {batch['waited_s']['p99']}s, "
              f"max {batch['waited_s']['max']}s; never claimed {batch['never_claimed']}")
    print(f"loss   preemptions {r['preemptions']}, work lost {r['work_lost_s']}s = {100 * r['work_lost_fraction']:.3f}% "
          f"of all work, leases lost {r['lost_leases']}")
    print(f"rate   peak {r['peak_per_s']['write']} writes/s at t={r['peak_at_s']['write']}s "
          f"(bucket limit then {r['limit_at_peak_per_s']['write']}/s), peak {r['peak_per_s']['read']} reads/s at "
          f"t={r['peak_at_s']['read']}s (limit {r['limit_at_peak_per_s']['read']}/s); throttled {r['throttled']}")
    e = r["extrapolated"]
    grows = (f"{e['per_worker_requests_companion']} at {r['companion']['workers']} x {r['companion']['tasks']}, "
             f"so +{e['per_worker_growth_per_tenfold']} per tenfold of tasks" if "companion" in r else "no companion run: held constant")  # fmt: skip
    print(f"model  R(W,T) = T x {e['per_task_requests']} (per task: lease, heartbeats, done marker, tombstone) "
          f"+ W x per_worker(T) (start, moves, sweeps, waiting at the end): {e['per_worker_requests']} here, {grows}")
    print(f"extrap {e['workers']} workers x {e['tasks']} tasks: per_worker {e['per_worker_requests_extrapolated']}, "
          f"{e['requests_per_task']} requests/task ({e['requests_per_task_without_heartbeats']} without heartbeats), "
          f"{e['total_requests']:.3g} requests, first claim <= "
          f"{e['first_claim_requests_max']} requests, peak ~{e['peak_writes_per_s']} writes/s and "
          f"~{e['peak_reads_per_s']} reads/s if the fleet boots as fast")


if __name__ == "__main__":
    main()
