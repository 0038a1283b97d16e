#!/usr/bin/env python3
"""Delete what a fleet left behind: a managed instance group, its template, TPU VMs.

    python tools/teardown.py --group spawn-worker --template spawn-worker --zone us-central1-a
    python tools/teardown.py --tpu-prefix spawn-tpu --zone us-west4-a --dry-run

`gcs-spawner down RUN` deletes exactly what `up` made for a run; this tool deletes by name, for fleets made by
hand. TPU queued resources are deleted with force (their nodes go with them); TPU nodes and queued resources are
chosen by id prefix and/or labels. --dry-run still lists TPUs to show what it would delete, one line per request.
Exit codes: 0 done, 1 the API refused, 2 usage.
"""

import argparse
import sys

from gcs_spawner.cli import failed


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--tpu-label must look like key=value, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", help="managed instance group to delete (with its VMs)")
    parser.add_argument("--template", help="instance template to delete (after the group)")
    parser.add_argument("--tpu-prefix", help="delete TPU queued resources and nodes whose id starts with this")
    parser.add_argument("--tpu-label", type=_label, action="append", default=[], help="key=value; TPUs must carry it")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--zone", help="zone of the group and TPUs (default: gcloud config)")
    where.add_argument("--region", help="region of a regional group")
    parser.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    parser.add_argument("--dry-run", action="store_true", help="print one line per delete request instead of sending it")
    parser.add_argument("--bodies", action="store_true", help="with --dry-run: print each request whole, as JSON")
    args = parser.parse_args(argv)
    if not (args.group or args.template or args.tpu_prefix or args.tpu_label):
        parser.error("name something to delete: --group, --template, --tpu-prefix or --tpu-label")
    try:
        from fleet import gapi, launch

        gapi.setup_logging()
        project = args.project or gapi.default_project()
        zone = args.zone or (None if args.region else gapi.default_zone())
        if not project or (args.group and not (zone or args.region)):
            parser.error("need --project, and --zone or --region for a group (or gcloud config defaults)")
        if (args.tpu_prefix or args.tpu_label) and not zone:
            parser.error("TPU teardown needs --zone")
        launch.teardown(
            project, zone=zone, region=args.region, group=args.group, template=args.template,
            tpu_prefix=args.tpu_prefix, tpu_labels=dict(args.tpu_label), dry_run=args.dry_run, bodies=args.bodies,
        )
    except Exception as err:  # noqa: BLE001 - failed() re-raises a bug
        return failed("teardown.py", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
