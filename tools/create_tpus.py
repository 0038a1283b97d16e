"""Create TPU VMs from a machine spec (templates/tpu.yaml): queued resources for spot, else nodes.

    python tools/create_tpus.py templates/tpu.yaml --count 32 --zone us-west4-a \
        --queue gs://B/jobs/J --code gs://B/code/NAME

First a pre-flight (also in --dry-run) checks the service account's roles and the bucket's
location (fleet/preflight.py; TPU quotas cannot be read through an API and are reported as not
checked); a shortfall stops the tool unless --force.
"""

import argparse
import shlex
import sys
from pathlib import Path

from fleet import gapi, launch, preflight, specs


def main() -> None:
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
    parser.add_argument("--dry-run", action="store_true", help="print the requests as JSON instead of sending them")
    parser.add_argument("--force", action="store_true", help="create even if the pre-flight finds a shortfall")
    parser.add_argument("--no-preflight", action="store_true", help="skip the pre-flight checks")
    args = parser.parse_args()
    gapi.setup_logging()
    if args.count <= 0 or args.first_index < 0:
        sys.exit(f"error: --count must be positive and --first-index not negative, got {args.count} and {args.first_index}")
    project = args.project or gapi.default_project()
    zone = args.zone or gapi.default_zone()
    if not project or not zone:
        sys.exit("error: need --project and --zone (or gcloud config defaults)")
    try:
        if not args.no_preflight:
            spec = specs.load_spec(args.spec)
            if isinstance(spec, specs.TpuSpec):
                request = preflight.request_for_tpus(spec, args.count * spec.slices, zone, args.queue)
                preflight.enforce(preflight.run_checks(project, request), force=args.force)
        launch.create_tpus(
            args.spec, project, zone, args.count, args.queue, args.code, first_index=args.first_index,
            consumer=args.consumer, spawn_flags=None if args.spawn_flags is None else shlex.split(args.spawn_flags),
            dry_run=args.dry_run,
        )
    except (specs.SpecError, gapi.LaunchError, preflight.PreflightError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
