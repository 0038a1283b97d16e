"""The systemd service's command: read the spawn-* attributes and exec spawn.py with them.

On a host of a multi-host TPU slice it adds the host's role (fleet/slice.py) as spawn.py options.

The unit file stays fixed (startup/spawn-worker.service); everything job-specific comes from
instance metadata each time the service starts. Extra flags are split with shlex, never handed
to a shell, so no metadata value is ever run as code.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

from fleet.metadata import MetadataClient
from fleet.slice import SliceMetadataError, host_role
from fleet.specs import ATTR_CONSUMER, ATTR_FLAGS, ATTR_QUEUE

log = logging.getLogger(__name__)

SPAWN = Path(__file__).resolve().parent.parent / "spawn.py"


class ServiceConfigError(Exception):
    """A spawn-* attribute the worker needs is missing or malformed."""


def worker_argv(metadata: MetadataClient, python: str = sys.executable, spawn: Path = SPAWN) -> list[str]:
    queue = metadata.attribute(ATTR_QUEUE)
    consumer = metadata.attribute(ATTR_CONSUMER)
    for name, value in ((ATTR_QUEUE, queue), (ATTR_CONSUMER, consumer)):
        if not value or not value.strip():
            raise ServiceConfigError(f"instance attribute {name!r} is not set; launch machines with tools/create_*.py")
    try:
        flags = shlex.split(metadata.attribute(ATTR_FLAGS, "") or "")
    except ValueError as err:
        raise ServiceConfigError(f"instance attribute {ATTR_FLAGS!r} is not valid shell-quoted words: {err}") from None
    argv = [python, str(spawn), queue.strip(), "--consumer", consumer, *flags]
    try:
        role = host_role(metadata)
    except SliceMetadataError as err:
        raise ServiceConfigError(f"this TPU host's slice metadata is inconsistent: {err}") from None
    if role is not None:
        # One claimant per slice: host 0 leads (claims, heartbeats, deletes the slice), the others follow.
        argv += role.spawn_flags()
    return argv


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    argv = worker_argv(MetadataClient())
    log.info("event=worker_exec argv=%s", shlex.join(argv))
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
