"""A warm task's fixed seconds, resident consumer against per-task consumers: real `spawn.py` workers over local queues
of `make run`'s job (tools/local_run.py: the random 4-layer Qwen2, three FineWeb-like parquet files, 40 rows a task),
each worker with a fresh cache directory, one after the other in one run.

For each task, in claim order, from its done marker: the claim-to-done seconds (`seconds`), the steady forward
seconds (its `goodput_ms_steady` counter) and their difference, the task's fixed seconds as the worker paid them.
Printed for both workers: the median fixed seconds of the tasks after the first, and that median over the first
task's (issue 44: at most 1.5 s and 25% with the resident consumer).

    .venv/bin/python bench/resident_bench.py              # make run's job, 8 tasks resident, 3 per task
    .venv/bin/python bench/resident_bench.py --rows-per-task 20 --json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from extract.phases import counter_name  # noqa: E402
from extract.tiny import write_fineweb_like_parquet, write_tiny_qwen  # noqa: E402


def make_job(root: pathlib.Path, rows_per_task: int) -> pathlib.Path:
    """make run's job (tools/local_run.py's defaults), its tasks planned by the same command."""
    model = write_tiny_qwen(root / "model", model_type="qwen2", hidden=128, layers=4, heads=4, kv_heads=2, vocab=512)
    data = write_fineweb_like_parquet(root / "data", n_files=3, rows_per_file=[130, 90, 100], seed=1)
    job = {"model": str(model), "data_files": [str(p) for p in data], "text_field": "text", "layers": [1, 2, -1],
           "max_seq_len": 128, "batch_size": 8, "dtype": "bf16", "shard_size": 32}  # fmt: skip
    job_file = root / "job.json"
    job_file.write_text(json.dumps(job))
    subprocess.run([sys.executable, "tools/make_tasks.py", str(job_file), "--rows-per-task", str(rows_per_task),
                    "-o", str(root / "tasks.jsonl")], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return job_file


def drain(root: pathlib.Path, name: str, job_file: pathlib.Path, resident: bool, max_tasks: int | None) -> list[dict]:
    """One worker drains a fresh queue of the job's tasks, with a fresh cache; the done markers in claim order."""
    from objectstore import open_store
    from taskqueue import layout

    queue = root / f"queue-{name}"
    queue.mkdir()
    subprocess.run([sys.executable, "tools/submit.py", str(queue), "--job", str(job_file), "--tasks",
                    str(root / "tasks.jsonl")], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPAWN_", "JAX_COMPILATION_CACHE", "EXTRACT_"))}
    env.update(XDG_CACHE_HOME=str(root / f"cache-{name}"), TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "spawn.py", str(queue), "--consumer", "python consume.py", "--worker-id", name,
               "--preemption-watch", "off", "--machine-record", "off", "--idle-timeout", "2", "--lease-ttl", "60",
               *(["--resident"] if resident else []), *(["--max-tasks", str(max_tasks)] if max_tasks else [])]  # fmt: skip
    started = time.monotonic()
    with open(root / f"{name}.log", "wb") as log:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{name}: spawn.py exited {code}; see {root / f'{name}.log'}")
    store = open_store(str(queue))
    # The counters travel in the markers' metadata (taskqueue.lease.marker_of).
    done = [{**json.loads(store.read(e.name).data), "counters": json.loads((e.metadata or {}).get("counters", "{}"))}
            for e in store.list(layout.DONE)]  # fmt: skip
    print(f"  {name}: {len(done)} tasks in {time.monotonic() - started:.1f} s", flush=True)
    return sorted(done, key=lambda marker: marker["claimed_at"])


def figures(done: list[dict]) -> dict:
    tasks = []
    for marker in done:
        steady = marker.get("counters", {}).get(counter_name("steady"), 0) / 1000
        ledger = sum(v for k, v in marker.get("counters", {}).items() if k.startswith("goodput_ms_")) / 1000
        tasks.append({"task": marker["task"], "seconds": marker["seconds"], "steady_s": steady, "ledger_s": ledger,
                      "fixed_s": marker["seconds"] - steady})  # fmt: skip
    warm = [t["fixed_s"] for t in tasks[1:]]
    median = statistics.median(warm) if warm else float("nan")
    return {"tasks": tasks, "first_fixed_s": tasks[0]["fixed_s"], "warm_median_fixed_s": median,
            "warm_over_first": median / tasks[0]["fixed_s"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-per-task", type=int, default=40, help="make run's ROWS_PER_TASK (default 40: 8 tasks)")
    p.add_argument("--per-task-tasks", type=int, default=3,
                   help="tasks the per-task worker runs (default 3: its warm tasks cost it 5 s or more each)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="resident-bench-") as scratch:
        root = pathlib.Path(scratch)
        job_file = make_job(root, args.rows_per_task)
        print(f"setup: make run's job, {args.rows_per_task} rows a task; load average {os.getloadavg()[0]:.1f}",
              flush=True)  # fmt: skip
        results = {name: figures(drain(root, name, job_file, resident, limit)) for name, resident, limit in
                   (("resident", True, None), ("per-task", False, args.per_task_tasks))}  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print("claim-to-done s - steady s = fixed s, per task in claim order (the ledger's sum in brackets)")
    for name, result in results.items():
        cells = "  ".join(f"{t['seconds']:.2f}-{t['steady_s']:.2f}={t['fixed_s']:.2f} [{t['ledger_s']:.2f}]"
                          for t in result["tasks"])  # fmt: skip
        print(f"  {name:9} {cells}")
    for name, result in results.items():
        print(f"{name:9} first task's fixed {result['first_fixed_s']:.2f} s; warm tasks' median fixed "
              f"{result['warm_median_fixed_s']:.2f} s ({result['warm_over_first']:.0%} of the first)")  # fmt: skip
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
