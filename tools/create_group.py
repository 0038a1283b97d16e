"""Create (or --resize) a managed instance group of workers from an instance template.

    python tools/create_group.py --template spawn-worker --size 200 --zone us-central1-a
    python tools/create_group.py --template spawn-worker --size 50 --region us-central1 --resize
"""

import argparse
import sys

from fleet import gapi, launch


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
    args = parser.parse_args()
    gapi.setup_logging()
    if args.size < 0:
        sys.exit(f"error: --size must be 0 or more, got {args.size}")
    project = args.project or gapi.default_project()
    zone = args.zone or (None if args.region else gapi.default_zone())
    if not project or not (zone or args.region):
        sys.exit("error: need --project and --zone or --region (or gcloud config defaults)")
    try:
        launch.create_group(
            project, args.template, args.size, zone=zone, region=args.region, name=args.name,
            resize=args.resize, dry_run=args.dry_run,
        )
    except gapi.LaunchError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
