#!/usr/bin/env python3
"""Plan the tasks of an extraction job: `make_tasks.py JOB --rows-per-task N -o tasks.jsonl`.

Reads only metadata: parquet row counts come from each file's footer (ranged reads on gs:// and
on the Hub); JSON Lines files are read through once to count their lines. Writes one task
manifest per line (docs/EXTRACTION.md).

`--rows-per-task auto --accelerator TYPE` sizes tasks to last about --target-minutes (default 10) on
that accelerator at the assumed --mfu, as tools/plan.py recommends: it tokenises a sample of rows
and prices nothing, but reads the accelerator's peak FLOP/s from reporting/prices.json.
"""

import argparse
import concurrent.futures
import json
import logging
import pathlib
import sys
import tempfile

from extract import data
from extract.errors import BadInput, exit_for_failure
from extract.job import Job, load_job, plan_tasks

log = logging.getLogger("make_tasks")


def _rows_per_task(args, job: Job, files: list[tuple[str, int]]) -> int:
    if args.rows_per_task != "auto":
        try:
            return int(args.rows_per_task)
        except ValueError:
            raise BadInput(f"--rows-per-task: got {args.rows_per_task!r}; use a positive integer or auto") from None
    if not args.accelerator:
        raise BadInput("--accelerator: missing; --rows-per-task auto sizes tasks for an accelerator, e.g. v6e-8")
    if args.fixed_seconds is not None and not args.fixed_seconds >= 0:
        raise BadInput(f"--fixed-seconds: got {args.fixed_seconds}; use seconds >= 0 (status's goodput line)")
    if not 0 < args.mfu <= 1 or not args.target_minutes > 0:
        raise BadInput(f"--mfu {args.mfu} / --target-minutes {args.target_minutes}: use an MFU in (0, 1], minutes > 0")
    from extract import costmodel  # the planner's figures, only for auto
    from reporting import pricing
    from reporting.plan import task_fixed_seconds

    try:
        prices = pricing.load_prices()
        machine = prices.accelerator(args.accelerator)
    except pricing.PriceError as exc:
        raise BadInput(str(exc)) from exc
    with tempfile.TemporaryDirectory(prefix="plan-model-") as workdir:  # a gs:// model's config and tokenizer
        config, _, model_dir = costmodel.model_config(job, args.model_config, pathlib.Path(workdir))
        tokenizer_dir = args.tokenizer or model_dir
        if tokenizer_dir is None:
            raise BadInput(f"--tokenizer: the model {job.model!r} is not local; pass a directory with its tokenizer")
        rows = sum(count for _, count in files)
        tokens = costmodel.measure_tokens(job, files, rows, tokenizer_dir, args.sample_rows)
    depth = max(costmodel.computed_layers(job.layers, config.num_hidden_layers))
    rate = machine.peak_flops * args.mfu
    fixed = task_fixed_seconds(job, config, depth, machine, prices, given=args.fixed_seconds)  # at most 2%, as plan.py
    chosen = costmodel.recommend_rows_per_task(config, depth, tokens, rate, args.target_minutes * 60, job.shard_size,
                                               fixed_seconds=fixed["warm_s"])  # fmt: skip
    log.info(
        "event=rows_per_task_auto accelerator=%s mfu=%g rows_per_task=%d task_minutes=%.3g tokens_per_row=%.1f",
        args.accelerator, args.mfu, chosen, chosen * costmodel.seconds_per_row(config, depth, tokens, rate) / 60,
        tokens.tokens_per_row,
    )
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="job.json")
    parser.add_argument(
        "--rows-per-task", required=True, help="rows (samples) per task, or auto (needs --accelerator)"
    )
    parser.add_argument("--accelerator", help="with --rows-per-task auto: the TPU or GPU machine type, e.g. v6e-8")
    parser.add_argument("--mfu", type=float, default=0.35, help="with auto: assumed MFU (default 0.35)")
    parser.add_argument("--target-minutes", type=float, default=10.0, help="with auto: task length (default 10)")
    parser.add_argument("--fixed-seconds", type=float, help="with auto: a task's fixed seconds on a warm machine, measured (status's goodput line); default: the platform's figure")
    parser.add_argument("--sample-rows", type=int, default=1024, help="with auto: rows tokenised (default 1024)")
    parser.add_argument("--model-config", help="with auto: config.json when the job's model is not local")
    parser.add_argument("--tokenizer", help="with auto: tokenizer directory when the job's model is not local")
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
        rows_per_task = _rows_per_task(args, job, list(zip(files, counts)))
        tasks = plan_tasks(list(zip(files, counts)), rows_per_task, args.id_prefix)
    except Exception as exc:
        return exit_for_failure(exc, log, "plan_failed")  # 65 bad input, 75 transient, as for consume.py
    lines = "".join(json.dumps(task.to_dict()) + "\n" for task in tasks)
    if args.output == "-":
        sys.stdout.write(lines)
    else:
        pathlib.Path(args.output).write_text(lines)
    log.info("event=planned files=%d rows=%d tasks=%d output=%s", len(files), sum(counts), len(tasks), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
