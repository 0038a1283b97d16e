"""Boot to first claim, in the boot rehearsal (tests/boot/rehearsal.py): a stock Debian machine with
no network but the fake Google APIs, booted from its metadata by the real startup/startup.sh, the real
gcloud and uv, with the code, uv, the interpreter and the cpu lock's wheels that the real
tools/upload_code.py put in the bucket.

    sudo .venv/bin/python -m bench.boot_bench        # needs root, mmdebstrap, iproute2, gcloud

Prints the upload, then each phase of a cold boot (new disk: interpreter, virtualenv, full install)
and of a warm one (a reboot of the same disk: the install is skipped), each ending at the worker's
first claim, and the wheelhouse's size. The root filesystem is built once and cached
(~/.cache/gcs-spawner/rootfs); the wheels come from pip's cache after the first run.
"""

from __future__ import annotations

import sys

from tests.boot import rehearsal

if __name__ == "__main__":
    sys.exit(rehearsal.main(sys.argv[1:]))
