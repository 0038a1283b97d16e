#!/usr/bin/env python3
"""Write job.json and the task manifests into a queue, create-only (`gcs-spawner submit`, gcs_spawner/cli.py,
under its old name): `submit.py QUEUE --job J --tasks T.jsonl`.

The job and every manifest are checked first, by the models consume.py uses (`--any-consumer`: tasks for another
consumer, checked only for ids); a bad one is refused (exit 65) and nothing is written. A submit that fails (a task
that exists with another manifest, a store error, Ctrl-C, SIGTERM) finishes its batch before it exits, so no
worker or status waits for it. `--finish-batch ID` finishes a batch whose submit died with its machine
(`tools/status.py` names it).
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("submit", argv)


if __name__ == "__main__":
    sys.exit(main())
