"""Create a Compute Engine instance template from a machine spec (templates/vm.yaml).

    python tools/create_template.py templates/vm.yaml --queue gs://B/jobs/J --code gs://B/code/NAME
"""

import argparse
import shlex
import sys
from pathlib import Path

from fleet import gapi, launch, specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="machine spec, kind: vm")
    parser.add_argument("--queue", required=True, help="gs:// URL of the job's queue prefix")
    parser.add_argument("--code", required=True, help="gs:// URL the code was uploaded to (tools/upload_code.py)")
    parser.add_argument("--name", help="template name (default: the spec's name)")
    parser.add_argument("--consumer", help="consumer command, overriding the spec's")
    parser.add_argument("--spawn-flags", help="extra spawn.py flags as one shell-quoted string, overriding the spec's")
    parser.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    parser.add_argument("--dry-run", action="store_true", help="print the request as JSON instead of sending it")
    args = parser.parse_args()
    gapi.setup_logging()
    project = args.project or gapi.default_project()
    if not project:
        sys.exit("error: no project; pass --project or set CLOUDSDK_CORE_PROJECT")
    try:
        launch.create_template(
            args.spec, project, args.queue, args.code, name=args.name, consumer=args.consumer,
            spawn_flags=None if args.spawn_flags is None else shlex.split(args.spawn_flags), dry_run=args.dry_run,
        )
    except (specs.SpecError, gapi.LaunchError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
