"""Create (or --resize) a managed instance group of workers from an instance template.

    python tools/create_group.py --template spawn-worker --size 200 --zone us-central1-a
    python tools/create_group.py --template spawn-worker --size 50 --region us-central1 --resize

First a pre-flight (also in --dry-run) reads the template back and checks the service account's
roles, the region's quotas and the bucket's location (fleet/preflight.py); a shortfall stops the
tool unless --force. New groups get instanceLifecyclePolicy.defaultActionOnFailure from --on-failure.
"""

import argparse
import sys

from fleet import compute, gapi, launch, preflight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--template", required=True, help="instance template name (tools/create_template.py)")
    parser.add_argument("--size", required=True, type=int, help="target number of VMs")
    parser.add_argument("--name", help="group name (default: the template's name)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--zone", help="a zonal group (default: CLOUDSDK_COMPUTE_ZONE or gcloud config)")
    where.add_argument("--region", help="a regional group, spread over the region's zones")
    parser.add_argument("--resize", action="store_true", help="resize the existing group to --size")
    parser.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    parser.add_argument("--dry-run", action="store_true", help="print the request as JSON instead of sending it")
    parser.add_argument("--force", action="store_true", help="create even if the pre-flight finds a shortfall")
    parser.add_argument("--no-preflight", action="store_true", help="skip the pre-flight checks")
    parser.add_argument(
        "--on-failure", choices=("repair", "do-nothing"), default="repair",
        help="what the group does with a member that stops or fails (instanceLifecyclePolicy.defaultActionOnFailure); "
        "do-nothing also keeps it from recreating preempted members (docs/CLOUD.md)",
    )
    args = parser.parse_args()
    gapi.setup_logging()
    if args.size < 0:
        sys.exit(f"error: --size must be 0 or more, got {args.size}")
    project = args.project or gapi.default_project()
    zone = args.zone or (None if args.region else gapi.default_zone())
    if not project or not (zone or args.region):
        sys.exit("error: need --project and --zone or --region (or gcloud config defaults)")
    try:
        if not args.no_preflight:
            clients = compute.ComputeClients.connect()
            try:
                template = clients.templates.get(project=project, instance_template=args.template)
            except gapi.API_ERRORS as err:
                print(f"preflight unchecked template: cannot read instance template {args.template!r}: {err}")
            else:
                request = preflight.request_for_template(template, args.size, zone, args.region)
                preflight.enforce(preflight.run_checks(project, request), force=args.force)
        launch.create_group(
            project, args.template, args.size, zone=zone, region=args.region, name=args.name,
            resize=args.resize, dry_run=args.dry_run, on_failure=args.on_failure.upper().replace("-", "_"),
        )
    except (gapi.LaunchError, preflight.PreflightError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
