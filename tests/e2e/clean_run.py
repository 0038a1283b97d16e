"""The clean reference for the chaos test: every task, one after another, in one process, no queue, no faults.

    python -m tests.e2e.clean_run JOB TASKS_JSONL OUT_DIR

Runs the same consumer loop (`extract.consumer.run`) that consume.py runs, with one engine shared
by all tasks, writing each task's shards to OUT_DIR/<task id>/.
"""

import json
import sys

from extract.consumer import RunInputs, run
from extract.job import Task, load_job


def main(job_file: str, tasks_file: str, out_dir: str) -> int:
    job = load_job(job_file)
    engine = None
    with open(tasks_file) as lines:
        for line in lines:
            task = Task.from_dict(json.loads(line))
            engine = run(RunInputs(job=job, task=task, output_url=f"{out_dir}/{task.id}"), engine=engine).engine
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
