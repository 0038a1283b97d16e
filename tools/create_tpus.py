#!/usr/bin/env python3
"""Create TPU VMs from a machine spec (templates/tpu.yaml): queued resources for spot, else nodes.

    python tools/create_tpus.py templates/tpu.yaml --count 32 --zone us-west4-a \
        --queue gs://B/jobs/J --code gs://B/code/NAME

`gcs-spawner up RUN` does this (and the rest) for a run. The spec's accelerator type must be one the planner
knows (reporting/prices.json), checked before anything else. Then a pre-flight (also in --dry-run) checks the
service account's roles and the bucket's location (fleet/preflight.py; TPU quotas cannot be read through an API and
are reported as not checked); a shortfall stops the tool unless --force. Exit codes: 0 done, 1 the API refused,
2 usage, 65 a bad spec, address, accelerator type or a pre-flight shortfall.
"""

import argparse
import shlex
import sys
from pathlib import Path

from gcs_spawner.cli import failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="machine spec, kind: tpu")
    parser.add_argument("--count", required=True, type=int, help="number of TPU VMs")
    parser.add_argument("--queue", required=True, help="gs:// URL of the job's queue prefix")
    parser.add_argument("--code", required=True, help="gs:// URL the code was uploaded to (tools/upload_code.py)")
    parser.add_argument("--first-index", type=int, default=0, help="number of the first VM (names are SPEC.name-NNNN)")
    parser.add_argument("--consumer", help="consumer command, overriding the spec's")
    parser.add_argument("--spawn-flags", help="extra spawn.py flags as one shell-quoted string, overriding the spec's")
    parser.add_argument("--zone", help="default: CLOUDSDK_COMPUTE_ZONE or gcloud config")
    parser.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    parser.add_argument("--dry-run", action="store_true", help="print one line per request instead of sending them")
    parser.add_argument("--bodies", action="store_true", help="with --dry-run: print each request whole, as JSON")
    parser.add_argument("--force", action="store_true", help="create even if the pre-flight finds a shortfall")
    parser.add_argument("--no-preflight", action="store_true", help="skip the pre-flight checks")
    args = parser.parse_args(argv)
    if args.count <= 0 or args.first_index < 0:
        parser.error(f"--count must be positive and --first-index not negative, got {args.count} and {args.first_index}")
    try:
        from fleet import gapi, launch, preflight, specs
        from objectstore.address import check_address
        from reporting import pricing

        gapi.setup_logging()
        queue, code = check_address(args.queue, "--queue", directory=False), check_address(args.code, "--code", directory=False)
        spec = specs.load_spec(args.spec)
        if isinstance(spec, specs.TpuSpec):
            try:
                pricing.check_machine_type(spec.accelerator_type, "tpu")
            except pricing.PriceError as err:
                raise specs.SpecError(f"{args.spec}: field 'accelerator_type': {err}") from None
        project = args.project or gapi.default_project()
        zone = args.zone or gapi.default_zone()
        if not project or not zone:
            parser.error("need --project and --zone (or gcloud config defaults)")
        if not args.no_preflight and isinstance(spec, specs.TpuSpec):
            request = preflight.request_for_tpus(spec, args.count * spec.slices, zone, queue)
            preflight.enforce(preflight.run_checks(project, request), force=args.force)
        launch.create_tpus(
            args.spec, project, zone, args.count, queue, code, first_index=args.first_index,
            consumer=args.consumer, spawn_flags=None if args.spawn_flags is None else shlex.split(args.spawn_flags),
            dry_run=args.dry_run, bodies=args.bodies,
        )
    except Exception as err:  # noqa: BLE001 - failed() re-raises a bug
        return failed("create_tpus.py", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
