#!/usr/bin/env python3
"""Keep a TPU fleet alive while its queue has work: `fleetctl.py keep`. (Not `fleet.py`: a script of that
name would shadow the fleet package it imports.)

    python tools/fleetctl.py keep templates/tpu.yaml --count 32 --zone us-west4-a,us-east5-b \
        --queue gs://B/jobs/J --code gs://B/code/NAME [--interval 60] [--once] [--dry-run]

`gcs-spawner keep RUN` does this for a run (and records what it makes, so that `down` deletes it). `--zone a,b`
and a repeated `--zone a --zone b` are the same: zones to create in, the first preferred. Every --interval seconds:
deletes SUSPENDED and FAILED queued resources named SPEC.name-NNNN and creates replacements up to --count (times
the spec's `slices`) only while claimable tasks outnumber the alive machines that hold no lease (fleet/keeper.py);
stops once the queue is complete as status says it (taskqueue/completion.py: every task has a done marker or a dead
letter, and no batch is still being submitted). Runs anywhere with credentials. Exit codes: 0 done,
1 the API refused, 2 usage, 65 a bad spec or address.
"""

import argparse
import shlex
import sys
from pathlib import Path

from gcs_spawner.cli import failed, zone_list


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    keep = sub.add_parser("keep", help="keep --count TPU VMs alive while the queue has pending tasks")
    keep.add_argument("spec", type=Path, help="machine spec, kind: tpu (queued resources)")
    keep.add_argument("--count", required=True, type=int,
                      help="TPU VMs (slices) to keep alive at most; with `slices: K` in the spec, K times this")
    keep.add_argument("--zone", dest="zones", action="append", default=[],
                      help="zones to create in, the first preferred: --zone a,b or --zone a --zone b")
    keep.add_argument("--queue", required=True, help="gs:// URL of the job's queue prefix")
    keep.add_argument("--code", required=True, help="gs:// URL the code was uploaded to (tools/upload_code.py)")
    keep.add_argument("--consumer", help="consumer command, overriding the spec's")
    keep.add_argument("--spawn-flags", help="extra spawn.py flags as one shell-quoted string, overriding the spec's")
    keep.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    keep.add_argument("--interval", type=float, default=60.0, help="seconds between checks (default 60)")
    keep.add_argument("--once", action="store_true", help="one check, then exit")
    keep.add_argument("--dry-run", action="store_true", help="list, and print the delete/create requests instead of sending them")
    args = parser.parse_args(argv)
    try:
        from fleet import gapi, keeper, specs, tpu
        from gcs_spawner.up import queue_work
        from objectstore import open_store
        from objectstore.address import check_address

        gapi.setup_logging()
        queue, code = check_address(args.queue, "--queue", directory=False), check_address(args.code, "--code", directory=False)
        project = args.project or gapi.default_project()
        zones = zone_list(args.zones) or [z for z in [gapi.default_zone()] if z]
        if not project or not zones:
            parser.error("need --project and --zone (or gcloud config defaults)")
        spec = specs.load_spec(args.spec)
        if not isinstance(spec, specs.TpuSpec):
            raise specs.SpecError(f"{args.spec}: kind {spec.kind!r} is not a TPU spec")
        launch = specs.Launch.make(spec, queue, code, args.consumer,
                                   None if args.spawn_flags is None else shlex.split(args.spawn_flags))
        fleet_keeper = keeper.Keeper(tpu.TpuClients.connect(), spec, launch, project, zones, args.count * spec.slices,
                                     queue_work(open_store(queue)), dry_run=args.dry_run)
        report = fleet_keeper.run(args.interval, max_steps=1 if args.once else None)
    except Exception as err:  # noqa: BLE001 - failed() re-raises a bug
        return failed("fleetctl.py keep", err)
    print(f"claimable={report.work.claimable} held={report.work.held} alive={len(report.alive)} deleted={len(report.deleted)} created={len(report.created)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
