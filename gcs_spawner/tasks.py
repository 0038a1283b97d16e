"""Cutting a job's data into task manifests (`gcs-spawner tasks`, tools/make_tasks.py, and `up` with
`tasks: {rows_per_task: N}`), and reading a tasks file by the model `consume.py` validates each manifest with.

Rows come from metadata only: parquet row counts from each file's footer (ranged reads on gs:// and on the Hub);
JSON Lines files are read through once to count their lines. `rows_per_task="auto"` sizes tasks to last about
`target_minutes` on an accelerator at an assumed MFU, as the planner recommends: it tokenises a sample of rows
and reads the accelerator's peak FLOP/s from reporting/prices.json.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import pathlib
import tempfile

from extract.errors import BadInput
from extract.job import Job, Task

log = logging.getLogger("make_tasks")


def count_rows(job: Job, workers: int = 16) -> list[tuple[str, int]]:
    """(file, rows) for every data file of the job, in the job's order."""
    from extract import data

    files = data.job_data_files(job)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(zip(files, pool.map(data.count_rows, files)))


def auto_rows_per_task(job: Job, files: list[tuple[str, int]], accelerator: str, mfu: float = 0.35,
                       target_minutes: float = 10.0, sample_rows: int = 1024, model_config: str | None = None,
                       tokenizer: str | None = None, fixed_seconds: float | None = None) -> int:
    """Rows per task so that a task lasts about `target_minutes` on `accelerator` at `mfu`, and at least long enough
    that its fixed seconds (`fixed_seconds`, measured: status's goodput line; else the platform's figure) stay
    within 2% of it, as the planner recommends (reporting/plan.py, `task_fixed_seconds`)."""
    from extract import costmodel
    from reporting import pricing
    from reporting.plan import task_fixed_seconds

    if fixed_seconds is not None and not fixed_seconds >= 0:
        raise BadInput(f"--fixed-seconds: got {fixed_seconds}; use seconds >= 0 (status's goodput line)")
    if not 0 < mfu <= 1 or not target_minutes > 0:
        raise BadInput(f"--mfu {mfu} / --target-minutes {target_minutes}: use an MFU in (0, 1], minutes > 0")
    try:
        prices = pricing.load_prices()
        machine = prices.accelerator(accelerator)
    except pricing.PriceError as exc:
        raise BadInput(str(exc)) from exc
    with tempfile.TemporaryDirectory(prefix="plan-model-") as workdir:  # a gs:// model's config and tokenizer
        config, _, model_dir = costmodel.model_config(job, model_config, pathlib.Path(workdir))
        tokenizer_dir = tokenizer or model_dir
        if tokenizer_dir is None:
            raise BadInput(f"--tokenizer: the model {job.model!r} is not local; pass a directory with its tokenizer")
        rows = sum(count for _, count in files)
        tokens = costmodel.measure_tokens(job, files, rows, tokenizer_dir, sample_rows)
    depth = max(costmodel.computed_layers(job.layers, config.num_hidden_layers))
    rate = machine.peak_flops * mfu
    fixed = task_fixed_seconds(job, config, depth, machine, prices, given=fixed_seconds)
    chosen = costmodel.recommend_rows_per_task(config, depth, tokens, rate, target_minutes * 60, job.shard_size,
                                               fixed_seconds=fixed["warm_s"])  # fmt: skip
    log.info(
        "event=rows_per_task_auto accelerator=%s mfu=%g rows_per_task=%d task_minutes=%.3g tokens_per_row=%.1f",
        accelerator, mfu, chosen, chosen * costmodel.seconds_per_row(config, depth, tokens, rate) / 60,
        tokens.tokens_per_row,
    )
    return chosen


def make_tasks(job: Job, rows_per_task: int, id_prefix: str = "t", files: list[tuple[str, int]] | None = None,
               workers: int = 16) -> list[Task]:
    """The job's task manifests, `rows_per_task` rows each (extract.job.plan_tasks), from `files` or the footers."""
    from extract.job import plan_tasks

    files = count_rows(job, workers) if files is None else files
    tasks = plan_tasks(files, rows_per_task, id_prefix)
    log.info("event=planned files=%d rows=%d tasks=%d", len(files), sum(c for _, c in files), len(tasks))
    return tasks


def encode(tasks: list[Task]) -> list[tuple[str, bytes]]:
    """(id, manifest bytes) as `taskqueue.submit.submit` takes them, encoded as `read_tasks` encodes a file's."""
    return [(t.id, json.dumps(t.to_dict(), sort_keys=True, separators=(",", ":")).encode()) for t in tasks]


def check_manifests(tasks: list[tuple[str, bytes]], where: str) -> list[Task]:
    """Every manifest through `Task`, the model consume.py validates a task with; BadInput names the first bad one."""
    checked = []
    for number, (task_id, data) in enumerate(tasks, start=1):
        try:
            checked.append(Task.from_dict(json.loads(data)))
        except BadInput as err:
            raise BadInput(f"{where}: task {task_id!r} (task {number}): {err}") from None
    return checked


def read_tasks(path: pathlib.Path) -> tuple[list[tuple[str, bytes]], list[Task]]:
    """A tasks file, parsed as the queue stores it (`taskqueue.submit.read_tasks`: ids, duplicates, sizes) and each
    manifest validated as `consume.py` will (`check_manifests`). BadInput names the file, line and field."""
    from taskqueue.submit import SubmitError
    from taskqueue.submit import read_tasks as queue_read_tasks

    try:
        encoded = queue_read_tasks(path)
    except SubmitError as err:
        raise BadInput(str(err)) from None
    except OSError as err:
        raise BadInput(f"{path}: cannot read the tasks file: {err.strerror or err}") from None
    return encoded, check_manifests(encoded, str(path))
