#!/usr/bin/env python3
"""Plan the tasks of an extraction job: `make_tasks.py JOB --rows-per-task N -o tasks.jsonl`.

Reads only metadata: parquet row counts come from each file's footer (ranged reads on gs:// and
on the Hub); JSON Lines files are read through once to count their lines. Writes one task
manifest per line (docs/EXTRACTION.md).
"""

import argparse
import concurrent.futures
import json
import logging
import pathlib
import sys

from extract import data
from extract.cli import EX_SOFTWARE, exit_code_for
from extract.job import load_job, plan_tasks

log = logging.getLogger("make_tasks")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="job.json")
    parser.add_argument("--rows-per-task", type=int, required=True, help="rows (samples) per task")
    parser.add_argument("-o", "--output", required=True, help="tasks file to write (JSON Lines), or - for stdout")
    parser.add_argument("--id-prefix", default="t", help="task ids are PREFIX + zero-padded index (default: t)")
    parser.add_argument("--workers", type=int, default=16, help="files whose footers are read concurrently")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        job = load_job(args.job)
        files = data.job_data_files(job)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
            counts = list(pool.map(data.count_rows, files))
        tasks = plan_tasks(list(zip(files, counts)), args.rows_per_task, args.id_prefix)
    except Exception as exc:
        code = exit_code_for(exc)  # 65 bad input, 75 transient, as for consume.py
        if code == EX_SOFTWARE:
            raise
        log.error("event=plan_failed exit=%d error=%s", code, exc)
        return code
    lines = "".join(json.dumps(task.to_dict()) + "\n" for task in tasks)
    if args.output == "-":
        sys.stdout.write(lines)
    else:
        pathlib.Path(args.output).write_text(lines)
    log.info("event=planned files=%d rows=%d tasks=%d output=%s", len(files), sum(counts), len(tasks), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
