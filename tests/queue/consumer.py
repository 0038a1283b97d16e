"""A consumer for queue tests, steered by its manifest. It follows the consumer contract exactly.

Manifest fields (all optional): `outputs` (how many outputs to write, default 1), `sleep` (seconds
before each output), `fail_attempts` (exit 1 on attempts up to this number), `exit` (exit with this
code at once, e.g. 65), `ignore_term` (keep running after SIGTERM).
Each output `part-<k>` holds "<task>:<k>" and gets one progress record; a resumed run starts after
the last committed record.
"""

import json
import os
import signal
import sys
import time

from objectstore import open_store


def main() -> int:
    manifest = json.load(open(os.environ["SPAWN_TASK_FILE"]))
    attempt = int(os.environ["SPAWN_ATTEMPT"])
    resume = json.load(open(os.environ["SPAWN_RESUME_FILE"]))
    if manifest.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)  # tests signal the worker only after this line
    if "exit" in manifest:
        print(f"exiting with {manifest['exit']} as told", flush=True)
        return int(manifest["exit"])
    if attempt <= int(manifest.get("fail_attempts", 0)):
        print(f"failing attempt {attempt} as told", flush=True)
        return 1
    out = open_store(os.environ["SPAWN_OUTPUT"])
    first = len(resume["progress"])
    for k in range(first, int(manifest.get("outputs", 1))):
        time.sleep(float(manifest.get("sleep", 0)))
        name = f"part-{k}"
        out.put(name, f"{manifest['id']}:{k}".encode())
        with open(os.environ["SPAWN_PROGRESS_FILE"], "a") as progress:
            progress.write(json.dumps({"output": out.url(name), "index": k}) + "\n")
    print(f"wrote outputs {first}..{int(manifest.get('outputs', 1)) - 1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
