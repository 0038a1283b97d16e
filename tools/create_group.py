#!/usr/bin/env python3
"""Create (or --resize) a managed instance group of workers from an instance template.

    python tools/create_group.py --template spawn-worker --count 200 --zone us-central1-a
    python tools/create_group.py --template spawn-worker --count 50 --region us-central1 --resize

`gcs-spawner up RUN` does this (and the rest) for a run. First a pre-flight (also in --dry-run) reads the template
back and checks the service account's roles, the region's quotas and the bucket's location (fleet/preflight.py); a
shortfall stops the tool unless --force. New groups get instanceLifecyclePolicy.defaultActionOnFailure from
--on-failure. Exit codes: 0 done, 1 the API refused, 2 usage, 65 a pre-flight shortfall.
"""

import argparse
import sys

from gcs_spawner.cli import failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--template", required=True, help="instance template name (tools/create_template.py)")
    parser.add_argument("--count", required=True, type=int, help="target number of VMs")
    parser.add_argument("--name", help="group name (default: the template's name)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--zone", help="a zonal group (default: CLOUDSDK_COMPUTE_ZONE or gcloud config)")
    where.add_argument("--region", help="a regional group, spread over the region's zones")
    parser.add_argument("--resize", action="store_true", help="resize the existing group to --count")
    parser.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    parser.add_argument("--dry-run", action="store_true", help="print one line per request instead of sending it")
    parser.add_argument("--bodies", action="store_true", help="with --dry-run: print each request whole, as JSON")
    parser.add_argument("--force", action="store_true", help="create even if the pre-flight finds a shortfall")
    parser.add_argument("--no-preflight", action="store_true", help="skip the pre-flight checks")
    parser.add_argument(
        "--on-failure", choices=("repair", "do-nothing"), default="repair",
        help="what the group does with a member that stops or fails (instanceLifecyclePolicy.defaultActionOnFailure); "
        "do-nothing also keeps it from recreating preempted members (docs/CLOUD.md)",
    )
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error(f"--count must be 0 or more, got {args.count}")
    try:
        from fleet import compute, gapi, launch, preflight

        gapi.setup_logging()
        project = args.project or gapi.default_project()
        zone = args.zone or (None if args.region else gapi.default_zone())
        if not project or not (zone or args.region):
            parser.error("need --project and --zone or --region (or gcloud config defaults)")
        if not args.no_preflight:
            clients = compute.ComputeClients.connect()
            try:
                template = clients.templates.get(project=project, instance_template=args.template)
            except gapi.API_ERRORS as err:
                if gapi.credentials_problem(err):
                    raise
                print(f"preflight unchecked template: cannot read instance template {args.template!r}: {err}")
            else:
                request = preflight.request_for_template(template, args.count, zone, args.region)
                preflight.enforce(preflight.run_checks(project, request), force=args.force)
        launch.create_group(
            project, args.template, args.count, zone=zone, region=args.region, name=args.name,
            resize=args.resize, dry_run=args.dry_run, on_failure=args.on_failure.upper().replace("-", "_"),
            bodies=args.bodies,
        )
    except Exception as err:  # noqa: BLE001 - failed() re-raises a bug
        return failed("create_group.py", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
