"""A consumer for queue tests, steered by its manifest. It follows the consumer contract exactly.

Manifest fields (all optional): `outputs` (how many outputs to write, default 1), `sleep` (seconds
before each output), `fail_attempts` (exit 1 on attempts up to this number), `exit` (exit with this
code at once, e.g. 65), `ignore_term` (keep running after SIGTERM), `die` (resident: the process
exits with this code in the middle of the task, without a reply).
Each output `part-<k>` holds "<task>:<k>" and gets one progress record (a resident one's holds its pid); a
resumed run starts after the last committed record.

With SPAWN_RESIDENT=1 it is a resident consumer (docs/PROTOCOL.md, "Resident consumers"): the
protocol loop of extract/resident.py serves each request with the same steps; an exit code of 0 or
65 keeps the process for the next task, any other ends it.
"""

import json
import os
import signal
import sys
import time

from objectstore import open_store


def main(env=os.environ) -> int:
    manifest = json.load(open(env["SPAWN_TASK_FILE"]))
    attempt = int(env["SPAWN_ATTEMPT"])
    resume = json.load(open(env["SPAWN_RESUME_FILE"]))
    if manifest.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)  # tests signal the worker only after this line
    if "exit" in manifest:
        print(f"exiting with {manifest['exit']} as told", flush=True)
        return int(manifest["exit"])
    if attempt <= int(manifest.get("fail_attempts", 0)):
        print(f"failing attempt {attempt} as told", flush=True)
        return 1
    if "die" in manifest:
        print(f"dying with {manifest['die']} as told", flush=True)
        os._exit(int(manifest["die"]))
    out = open_store(env["SPAWN_OUTPUT"])
    first = len(resume["progress"])
    for k in range(first, int(manifest.get("outputs", 1))):
        time.sleep(float(manifest.get("sleep", 0)))  # the task's own work time, as its manifest asks
        name = f"part-{k}"
        out.put(name, f"{manifest['id']}:{k}".encode())
        with open(env["SPAWN_PROGRESS_FILE"], "a") as progress:
            record = {"output": out.url(name), "index": k}
            if env is not os.environ:  # resident: which process served the task
                record["pid"] = os.getpid()
            progress.write(json.dumps(record) + "\n")
    print(f"wrote outputs {first}..{int(manifest.get('outputs', 1)) - 1}", flush=True)
    return 0


def serve() -> int:
    from extract import resident

    replies = resident.take_stdout()

    def run_task(request: resident.Request) -> resident.Outcome:
        code = main(request.env)
        return resident.Outcome(code, stays=code in (0, 65))

    return resident.serve(run_task, sys.stdin.buffer, replies)


if __name__ == "__main__":
    sys.exit(serve() if os.environ.get("SPAWN_RESIDENT") == "1" else main())
