#!/usr/bin/env python3
"""Create a Compute Engine instance template from a machine spec (templates/vm.yaml).

    python tools/create_template.py templates/vm.yaml --queue gs://B/jobs/J --code gs://B/code/NAME

`gcs-spawner up RUN` does this (and the rest) for a run; this tool is the one step, for a template made by hand.
The spec's machine type must be one the price table knows (reporting/prices.json), so a fleet's cost can be
stated. Exit codes: 0 done, 1 the API refused, 2 usage, 65 a bad spec, address or machine type.
"""

import argparse
import shlex
import sys
from pathlib import Path

from gcs_spawner.cli import failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="machine spec, kind: vm")
    parser.add_argument("--queue", required=True, help="gs:// URL of the job's queue prefix")
    parser.add_argument("--code", required=True, help="gs:// URL the code was uploaded to (tools/upload_code.py)")
    parser.add_argument("--name", help="template name (default: the spec's name)")
    parser.add_argument("--consumer", help="consumer command, overriding the spec's")
    parser.add_argument("--spawn-flags", help="extra spawn.py flags as one shell-quoted string, overriding the spec's")
    parser.add_argument("--project", default=None, help="default: CLOUDSDK_CORE_PROJECT or gcloud config")
    parser.add_argument("--dry-run", action="store_true", help="print one line per request instead of sending it")
    parser.add_argument("--bodies", action="store_true", help="with --dry-run: print each request whole, as JSON")
    args = parser.parse_args(argv)
    try:
        from fleet import gapi, launch, specs
        from objectstore.address import check_address
        from reporting import pricing

        gapi.setup_logging()
        queue, code = check_address(args.queue, "--queue", directory=False), check_address(args.code, "--code", directory=False)
        spec = specs.load_spec(args.spec)
        if isinstance(spec, specs.VmSpec):
            pricing.check_machine_type(spec.machine_type, "vm")
        project = args.project or gapi.default_project()
        if not project:
            parser.error("no project; pass --project or set CLOUDSDK_CORE_PROJECT")
        launch.create_template(
            args.spec, project, queue, code, name=args.name, consumer=args.consumer,
            spawn_flags=None if args.spawn_flags is None else shlex.split(args.spawn_flags), dry_run=args.dry_run,
            bodies=args.bodies,
        )
    except Exception as err:  # noqa: BLE001 - failed() re-raises a bug
        return failed("create_template.py", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
