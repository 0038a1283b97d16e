"""What a job will cost, before it is launched: `gcs-spawner plan RUN`, or a job alone with
`gcs-spawner plan JOB --accelerator v5litepod-8 [--tasks tasks.jsonl]` (tools/plan.py under its old name).

Prints tokens, FLOPs to the deepest layer, machine-hours at an assumed MFU, on-demand and spot dollars, output
bytes and their Cloud Storage cost per month, the storage operations of the claim protocol, and a
--rows-per-task that makes a task last about --target-minutes. Warns loudly when the output is large.

A job that samples its tokens (`token_sample`, `drop_first`) is planned for what it stores: tokens, bytes, shards,
storage dollars and operations; `--storage-budget-tb` suggests the token_sample whose output fits, and says how
many documents keep at least one token at that rate (the diversity a sample rate buys, against fewer rows).

Rows come from the tasks file, else from the data files' parquet footers, else from --rows. Tokens per row come
from tokenising a sample of rows (--sample-rows) with the checkpoint's tokenizer, else from --tokens-per-row.
A job on a Hub model or dataset can be planned without the Hub:

    gcs-spawner plan job.json --accelerator v6e-8 --rows 9672101 --tokens-per-row 1040

(the model's config.json comes from --model-config, a local or gs:// checkpoint directory, whose weights are never
read, or a built-in copy for a few Hub ids: extract/costmodel.py, KNOWN_CONFIGS).
The formulas are in extract/costmodel.py, the prices in reporting/prices.json (dated; --prices for another copy).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import math
import pathlib
import re
import tempfile

from activations.format import output_key, sites_of
from extract import costmodel
from extract.errors import BadInput
from extract.job import Job, Task, load_job
from reporting import pricing
from reporting.planflags import JOB_FLAGS, add_job_arguments
from reporting.planrender import _n, _si, render  # noqa: F401 (render: the plan's text, for its callers)

log = logging.getLogger("plan")

TB = 1e12
GIB = 2**30
#: google-cloud-storage sends an object of at most 8 MiB in one multipart request; a larger one as a resumable
#: upload: one request to start it and one per 100 MiB chunk (the client library's defaults).
ONE_REQUEST_UPLOAD = 8 * 2**20
RESUMABLE_CHUNK = 100 * 2**20
#: Listings before a worker's first claim (docs/PROTOCOL.md, "Claim"): splits/ and swept/, then one region's
#: tasks/ and leases/, whatever the queue's size.
STARTUP_LISTINGS = 4
#: GPUs of compute capability 9.0 or later, whose cuDNN flash attention takes head_dim up to 256
#: (extract/kernel_choice.py): Hopper (H100, H200) and Blackwell (B200) per https://developer.nvidia.com/cuda-gpus;
#: the A100 is 8.0, the L4 8.9, the T4 7.5.
HOPPER_OR_LATER = re.compile(r"\b(H100|H200|B200|GB200)\b")
#: Above this a shard is worth a warning: the writer holds a whole shard in host memory while it uploads it.
SHARD_WARN_BYTES = 4 * 2**30


@dataclasses.dataclass
class PlanInputs:
    """What the planner takes: tools/plan.py's flags (`parse_args`), or a run file's job, tasks, fleet and `plan`
    section (gcs_spawner). `job` is a job.json path or a validated `Job`; `task_list` holds tasks already read (a
    run's), instead of a `tasks` file; `job_label` names the job in the plan's first line."""

    job: str | Job
    accelerator: str
    tasks: str | None = None
    task_list: list[Task] | None = None
    rows: int | None = None
    tokens_per_row: float | None = None
    stats: str | None = None
    sample_rows: int = 1024
    model_config: str | None = None
    tokenizer: str | None = None
    mfu: float = 0.35
    machines: int = 32
    target_minutes: float = 10.0
    fixed_seconds: float | None = None
    heartbeat: float = 30.0
    storage: str = "region"
    months: float = 1.0
    warn_output_tb: float = 10.0
    storage_budget_tb: float | None = None
    prices: str | None = None
    json: bool = False
    job_label: str | None = None
    stats_source: str | None = None
    queue: str | None = None  # a queue whose done markers' ledgers give the fixed seconds (`ledgers_of`)


def job_inputs(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs of `gcs-spawner plan JOB --accelerator TYPE ...` (`args.run` is the job file)."""
    return PlanInputs(job=str(args.run), prices=args.prices, json=args.json,
                      **{name: getattr(args, name) for name in JOB_FLAGS})  # fmt: skip


def parse_args(argv) -> PlanInputs:
    """PlanInputs from the command line of a job alone: `JOB --accelerator TYPE [flags]` (for tests and tools)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="job", help="job.json")
    add_job_arguments(p)
    p.add_argument("--prices", help="price table JSON (default: reporting/prices.json)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    if args.accelerator is None:
        p.error("--accelerator is required")
    return job_inputs(args)


def _check_flags(args) -> None:
    if not 0 < args.mfu <= 1:
        raise BadInput(f"--mfu: got {args.mfu}; use a fraction in (0, 1], e.g. 0.35")
    for name in ("machines", "sample_rows"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')}: got {getattr(args, name)}; use a positive integer")
    for name in ("target_minutes", "heartbeat", "months", "warn_output_tb"):
        if not getattr(args, name) > 0:
            raise BadInput(f"--{name.replace('_', '-')}: got {getattr(args, name)}; use a positive number")
    if args.tasks and (args.rows is not None or args.stats):
        raise BadInput("--rows/--stats: the rows come from --tasks; give one or the other")
    if args.rows is not None and args.rows <= 0:
        raise BadInput(f"--rows: got {args.rows}; use a positive number of rows")
    if args.storage_budget_tb is not None and not args.storage_budget_tb > 0:
        raise BadInput(f"--storage-budget-tb: got {args.storage_budget_tb}; use a positive number of TB")
    if args.fixed_seconds is not None and not args.fixed_seconds >= 0:
        raise BadInput(f"--fixed-seconds: got {args.fixed_seconds}; use seconds >= 0 (status's goodput line)")
    if args.tokens_per_row is not None and not args.tokens_per_row > 0:
        raise BadInput(f"--tokens-per-row: got {args.tokens_per_row}; use a positive number")


def _read_stats(args) -> None:
    """--stats fills --rows and --tokens-per-row where they were not given."""
    if not args.stats:
        return
    try:
        raw = json.loads(pathlib.Path(args.stats).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"--stats: cannot read {args.stats} as JSON ({exc}); fix the file") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("rows"), int) or raw["rows"] <= 0:
        raise BadInput(f'--stats: {args.stats} needs "rows": a positive integer')
    per_row = raw.get("tokens_per_row")
    if per_row is not None and (isinstance(per_row, bool) or not isinstance(per_row, (int, float)) or per_row <= 0):
        raise BadInput(f'--stats: {args.stats} "tokens_per_row" must be a positive number')
    args.rows = args.rows or raw["rows"]
    args.tokens_per_row = args.tokens_per_row or per_row
    args.stats_source = f"{args.stats}: {raw['source']}" if raw.get("source") else args.stats


def _tasks(path: str) -> list[Task]:
    tasks = []
    try:
        lines = pathlib.Path(path).read_text().splitlines()
    except OSError as exc:
        raise BadInput(f"--tasks: cannot read {path} ({exc.strerror or exc}); check the path") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"--tasks: line {number} of {path} is not JSON ({exc})") from exc
        try:
            tasks.append(Task.from_dict(raw))
        except BadInput as exc:
            raise BadInput(f"--tasks: line {number} of {path}: {exc}") from exc
    if not tasks:
        raise BadInput(f"--tasks: {path} holds no tasks; run gcs-spawner tasks first")
    return tasks


def _file_rows(job: Job, tasks: list[Task] | None) -> list[tuple[str, int]]:
    """(path, rows) per data file: the rows the tasks take from each, or every file's footer count."""
    if tasks is not None:
        rows: dict[str, int] = {}
        for task in tasks:
            for entry in task.files:
                rows[entry.path] = max(rows.get(entry.path, 0), entry.end)
        return list(rows.items())
    if job.dataset is not None:
        raise BadInput(
            f"dataset: {job.dataset.name} would be resolved on the Hub; give --tasks (from make_tasks.py) "
            "or --rows and --tokens-per-row"
        )
    from extract import data

    files = data.job_data_files(job)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        return list(zip(files, pool.map(data.count_rows, files)))


def estimate_tokens(job: Job, args, tasks, model_dir) -> tuple[costmodel.TokenEstimate, str]:
    """The token estimate and where its row count came from."""
    files = None
    if tasks is not None:
        rows = sum(t.num_samples for t in tasks)
        rows_source = f"{len(tasks)} task manifests in {args.tasks or 'the run'}"
    elif args.rows is not None:
        rows, rows_source = args.rows, args.stats or "given (--rows)"
    else:
        files = _file_rows(job, None)
        rows, rows_source = sum(c for _, c in files), f"parquet footers of {len(files)} data files"
    if args.tokens_per_row is not None:
        where = args.stats_source or "given (--tokens-per-row)"
        estimate = costmodel.TokenEstimate.from_mean(
            rows, args.tokens_per_row, job.max_seq_len, f"{where}; every row taken at the mean length"
        )
        return estimate, rows_source
    tokenizer_dir = args.tokenizer or model_dir
    if tokenizer_dir is None:
        raise BadInput(
            f"model: {job.model!r} is not local, so no tokenizer for a sample; pass --tokenizer DIR or "
            "--tokens-per-row"
        )
    if files is None:
        files = _file_rows(job, tasks)
    return costmodel.measure_tokens(job, files, rows, tokenizer_dir, args.sample_rows), rows_source


def _upload_requests(shard_bytes: float) -> int:
    if shard_bytes <= ONE_REQUEST_UPLOAD:
        return 1
    return 1 + math.ceil(shard_bytes / RESUMABLE_CHUNK)


def make_plan(inputs: PlanInputs) -> dict:
    """The whole plan as a JSON-ready dict; every figure is derived in this function from the inputs shown."""
    args = dataclasses.replace(inputs)  # _read_stats fills in rows and tokens per row: the caller's inputs stay
    with tempfile.TemporaryDirectory(prefix="plan-model-") as workdir:  # a gs:// model's config and tokenizer
        return _make_plan(args, pathlib.Path(workdir))


def _make_plan(args, workdir: pathlib.Path) -> dict:
    _check_flags(args)
    _read_stats(args)
    prices = pricing.load_prices(args.prices)
    machine = prices.accelerator(args.accelerator)
    storage = prices.storage_prices(args.storage)
    job = args.job if isinstance(args.job, Job) else load_job(args.job)
    config, config_source, model_dir = costmodel.model_config(job, args.model_config, workdir)
    outputs = costmodel.job_outputs(job, config)
    layers = [output for output in outputs if isinstance(output, int)]
    depth = config.depth_for(outputs)
    tasks = args.task_list if args.task_list is not None else (_tasks(args.tasks) if args.tasks else None)
    tokens, rows_source = estimate_tokens(job, args, tasks, model_dir)

    # Compute and time. MFU is useful work over peak: padding and compilation are inside the (1 - MFU).
    flops = costmodel.job_flops(config, depth, tokens)
    rate = machine.peak_flops * args.mfu
    machine_hours = flops / rate / 3600
    seconds_per_row = costmodel.seconds_per_row(config, depth, tokens, rate)
    fixed = task_fixed_seconds(job, config, depth, machine, prices, given=args.fixed_seconds,
                               measured=ledgers_of(args.queue) if args.fixed_seconds is None else None)
    recommended = costmodel.recommend_rows_per_task(
        config, depth, tokens, rate, args.target_minutes * 60, job.shard_size, fixed_seconds=fixed["warm_s"]
    )
    task_rows = [t.num_samples for t in tasks] if tasks else costmodel.split_rows(tokens.rows, recommended)
    rows_per_task = max(task_rows) if task_rows else 0

    # Output.
    header = costmodel.shard_header_bytes(job, tasks[0] if tasks else None)
    out = costmodel.output_bytes(job, costmodel.output_widths(config, outputs), tokens, task_rows, header)
    # A typical full shard: shard_size rows, or fewer where shard_bytes cuts it first (extract.batching.ShardBounds).
    full_shard_rows = costmodel.rows_per_shard(job, out.stored_tokens_per_row, out.bytes_per_token)
    shard_rows = min(full_shard_rows, rows_per_task)
    shard_bytes = shard_rows * (out.stored_tokens_per_row * out.bytes_per_token + 16) + header
    storage_month = out.total / GIB * storage.standard_per_gib_month

    # Storage operations (docs/PROTOCOL.md, "Cost"). Class A: object writes and listings
    # (https://cloud.google.com/storage/pricing#operations-by-class).
    n_tasks = len(task_rows)
    task_seconds = [rows * seconds_per_row for rows in task_rows]
    heartbeats = sum(int(s // args.heartbeat) for s in task_seconds)
    shard_writes = out.shards * _upload_requests(shard_bytes)
    startup_lists = args.machines * STARTUP_LISTINGS
    class_a = {
        "lease_creates": n_tasks,
        "done_markers": n_tasks,
        "tombstones": n_tasks,
        "heartbeats": heartbeats,
        "shard_uploads": shard_writes,
        "startup_listings": startup_lists,
    }
    class_a_total = sum(class_a.values())
    ops_dollars = class_a_total / 1000 * storage.class_a_per_1000

    on_demand = machine_hours * machine.on_demand_per_hour
    spot = machine_hours * machine.spot_per_hour
    # Tasks run in rounds of --machines; with tasks of equal size the last round bounds the makespan (machine boot
    # and model loading come on top). Machines with nothing left delete themselves, so billing follows the work.
    rounds = math.ceil(n_tasks / args.machines) if n_tasks else 0
    # Fixed seconds: every task's start and tail, and each machine's first task's copy and compiles.
    fixed_hours = fixed_machine_hours(fixed, n_tasks, args.machines)
    fixed.update(machine_hours=fixed_hours, on_demand=fixed_hours * machine.on_demand_per_hour,
                 spot=fixed_hours * machine.spot_per_hour)  # fmt: skip
    wall_hours = rounds * (sum(task_seconds) / n_tasks / 3600) if n_tasks else 0.0
    plan = {
        "job": args.job_label or str(args.job),
        "model": {"name": job.model, "config": config_source, "model_type": config.model_type,
                  "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers},
        "layers": list(layers),
        "sites": sites_of(outputs),
        "layers_computed": depth,
        "tokens": {
            "rows": tokens.rows,
            "rows_source": rows_source,
            "tokens_per_row": tokens.tokens_per_row,
            "tokens": tokens.tokens,
            "source": tokens.source,
            "sampled_rows": tokens.sampled_rows,
            "max_seq_len": job.max_seq_len,
        },
        "compute": {
            "flops": flops,
            "flops_per_token": flops / tokens.tokens if tokens.tokens else 0.0,
            "projection_flops_per_token_per_layer": costmodel.projection_flops_per_token(config),
            "attention_flops_per_token_per_key_per_layer": costmodel.attention_flops_per_token_per_key(config),
        },
        "accelerator": {
            "name": machine.name, "family": machine.family, "chips": machine.chips, "hosts": machine.hosts,
            "peak_flops": machine.peak_flops, "mfu": args.mfu, "platform": machine.platform,
            "peak_source": machine.peak_assumed or "the price table's datasheet peak (dense bf16)",
            "on_demand_per_hour": machine.on_demand_per_hour, "spot_per_hour": machine.spot_per_hour,
        },
        "time": {
            "machine_hours": machine_hours,
            "chip_hours": machine_hours * machine.chips,
            "machines": args.machines,
            "wall_clock_hours": wall_hours,
            "rounds": rounds,
            "seconds_per_row": seconds_per_row,
        },
        "compute_dollars": {"on_demand": on_demand, "spot": spot},
        "tasks": {
            "count": n_tasks,
            "from": args.tasks or ("the run's tasks" if args.task_list is not None else
                                   f"recommended rows_per_task={recommended}"),
            "max_rows": rows_per_task,
            "mean_minutes": (sum(task_seconds) / n_tasks / 60) if n_tasks else 0.0,
            "recommended_rows_per_task": recommended,
            "recommended_task_minutes": recommended * seconds_per_row / 60,
            "target_minutes": args.target_minutes,
            "fixed": {**fixed, "max_share": costmodel.FIXED_SHARE,
                      "min_task_minutes": costmodel.min_task_seconds(fixed["warm_s"]) / 60,
                      # of a task of the recommended size, and of the job's tasks (a short last one included)
                      "share_of_task": fixed["warm_s"] / (fixed["warm_s"] + recommended * seconds_per_row),
                      "share_of_job": n_tasks * fixed["warm_s"] / (n_tasks * fixed["warm_s"] + sum(task_seconds))
                      if n_tasks else None},
        },
        "output": {
            "bytes": out.total,
            "bytes_per_token": out.bytes_per_token,
            "activation_bytes": out.token_bytes,
            "sample_bytes": out.sample_bytes,
            "header_bytes": out.header_bytes,
            "shards": out.shards,
            "shard_bytes": shard_bytes,
            "shard_rows": shard_rows,
            "shard_cut_by": "shard_bytes" if full_shard_rows < job.shard_size else "shard_size",
            "dtype": job.dtype,
        },
        "storage": {
            "location": storage.location,
            "per_gib_month": storage.standard_per_gib_month,
            "dollars_per_month": storage_month,
            "months": args.months,
            "dollars": storage_month * args.months,
        },
        "operations": {
            "class_a": class_a,
            "class_a_total": class_a_total,
            "class_a_per_1000": storage.class_a_per_1000,
            "dollars": ops_dollars,
            "per_task": class_a_total / n_tasks if n_tasks else 0.0,
        },
        "total_dollars": {
            "on_demand": on_demand + fixed_hours * machine.on_demand_per_hour + storage_month * args.months + ops_dollars,
            "spot": spot + fixed_hours * machine.spot_per_hour + storage_month * args.months + ops_dollars,
        },
        "prices": {"file": prices.source, "as_of": prices.as_of, "sources": dict(prices.sources)},
    }
    plan["sampling"] = sampling_figures(job, tokens, out)
    widths = costmodel.output_widths(config, outputs)
    if args.storage_budget_tb is not None:
        plan["storage_budget"] = budget_figures(args.storage_budget_tb * TB, job, widths, tokens, task_rows, header,
                                                storage.standard_per_gib_month)  # fmt: skip
    fits_warning = None
    if out.total > args.warn_output_tb * TB:
        fits_warning = costmodel.suggest_token_sample(args.warn_output_tb * TB, job, widths, tokens, task_rows,
                                                      header)  # fmt: skip
    plan["memory"] = memory_plan(job, config, outputs, machine, prices)
    plan["warnings"] = (warnings(plan, args, job, config, tokens, outputs, prices, fits_warning)
                        + memory_warnings(plan["memory"]))  # fmt: skip
    return plan


def sampling_figures(job: Job, tokens: costmodel.TokenEstimate, out: costmodel.OutputEstimate) -> dict:
    """What the job's storage sampling keeps: tokens stored of those processed, and documents covered."""
    sampling = job.sampling
    covered = costmodel.documents_covered(tokens, sampling)
    stored = tokens.rows * out.stored_tokens_per_row
    return {
        "token_sample": sampling.fraction,
        "drop_first": sampling.drop_first,
        "seed": sampling.seed,
        "processed_tokens": tokens.tokens,
        "stored_tokens": stored,
        "stored_fraction": stored / tokens.tokens if tokens.tokens else 0.0,
        "documents_covered": covered * tokens.rows,
        "documents_covered_fraction": covered,
        "stored_tokens_per_covered_document": stored / (covered * tokens.rows) if covered else 0.0,
    }


def budget_figures(budget: float, job: Job, widths, tokens, task_rows, header: int, per_gib_month: float) -> dict:
    """The token_sample that fits `budget` bytes (costmodel.suggest_token_sample), what it stores and costs, and the
    diversity it keeps beside the other way to fit: all tokens of fewer rows."""
    fraction = costmodel.suggest_token_sample(budget, job, widths, tokens, task_rows, header)
    figures: dict = {"tb": budget / TB, "token_sample": fraction}
    if fraction is None:
        return figures
    sampled = job.model_copy(update={"token_sample": fraction})
    out = costmodel.output_bytes(sampled, widths, tokens, task_rows, header)
    unsampled = costmodel.output_bytes(job.model_copy(update={"token_sample": 1.0, "drop_first": 0}), widths, tokens,
                                       task_rows, header)  # fmt: skip
    figures.update(
        bytes=out.total,
        shards=out.shards,
        dollars_per_month=out.total / GIB * per_gib_month,
        **{k: v for k, v in sampling_figures(sampled, tokens, out).items() if k not in ("token_sample", "seed")},
        rows_if_unsampled=int(tokens.rows * min(1.0, budget / unsampled.total)),
    )
    return figures


def memory_plan(job: Job, config, outputs, machine: pricing.Accelerator, prices: pricing.PriceTable) -> dict:
    """What one step of the job needs per chip, and the largest batch_size that fits (extract/memory.py).

    The chip's memory comes from the cited HBM table (the engine asks the runtime instead), the attention kernel from
    the engine's own decision for that platform and dtype. Chips form a pure data-parallel mesh when one replica
    fits a chip, else the smallest model axis that fits, as the engine chooses.
    """
    from extract import kernel_choice, memory

    platform = machine.platform
    usable = machine.memory_bytes if platform == "cpu" else memory.usable_bytes(machine.family, platform)
    kernel = kernel_choice.for_model(platform, job.compute_dtype_name, config,
                                     hopper=bool(HOPPER_OR_LATER.search(machine.family))).kernel  # fmt: skip
    shape = dict(
        config=config, depth=config.depth_for(outputs), kept=config.hidden_units(outputs),
        compute_bytes=costmodel.DTYPE_BYTES[job.compute_dtype], out_bytes=costmodel.DTYPE_BYTES[job.dtype],
        kernel=kernel, packed=job.packing,
    )  # fmt: skip
    axes = [m for m in range(1, machine.chips + 1) if machine.chips % m == 0]
    model_axis = axes[0]
    if usable is not None:  # the smallest model axis whose weights and one row fit
        fitting = [m for m in axes if memory.rows_that_fit(usable, seq_len=job.max_seq_len, model_axis=m, **shape)]
        model_axis = fitting[0] if fitting else axes[-1]
    data_axis = machine.chips // model_axis
    step = memory.step_memory(
        rows=max(1, job.batch_size // data_axis), seq_len=job.max_seq_len, model_axis=model_axis, **shape
    )  # fmt: skip
    rows = None if usable is None else memory.rows_that_fit(usable, seq_len=job.max_seq_len, model_axis=model_axis,
                                                             **shape)  # fmt: skip
    return {
        "chip": machine.family,
        "usable_bytes_per_chip": usable,
        "source": ("the machine's memory (the price table's memory_gib)" if platform == "cpu" else
                   "HBM per chip (extract/memory.py) x what the JAX client allocates of it") if usable else "unknown",
        "attention": kernel,
        "mesh": {"data": data_axis, "model": model_axis},
        "batch_size": job.batch_size,
        "step_bytes_per_chip": step.total,
        "step": dataclasses.asdict(step),
        "max_batch_size": None if rows is None else rows * data_axis,
        "max_tokens_per_step": None if rows is None else rows * data_axis * job.max_seq_len,
        "fits": None if usable is None else step.total <= memory.HEADROOM * usable,
        "headroom": memory.HEADROOM,
    }


def memory_warnings(plan_memory: dict) -> list[str]:
    m = plan_memory
    if m["fits"] is None:
        return [f"device memory of {m['chip']} unknown: batch_size {m['batch_size']} is not checked against it"]
    if not m["fits"]:
        fit = m["max_batch_size"]
        remedy = f"use batch_size {fit} or less" if fit else "use a smaller max_seq_len, or a larger chip"
        return [
            f"batch_size {m['batch_size']} does not fit {m['chip']}: a step needs {_si(m['step_bytes_per_chip'], 'B')} "
            f"per chip, over {m['headroom']:.0%} of its {_si(m['usable_bytes_per_chip'], 'B')}; the engine refuses it "
            f"(exit 65): {remedy}"
        ]
    return []


def warnings(plan, args, job, config, tokens, outputs, prices, fits_warning: float | None = None) -> list[str]:
    """`fits_warning`: the token_sample whose output fits under --warn-output-tb (costmodel.suggest_token_sample)."""
    out = []
    total = plan["output"]["bytes"]
    limit = args.warn_output_tb * TB
    if total > limit:
        per_output = plan["sampling"]["stored_tokens"] * costmodel.value_bytes_per_token(job, [config.hidden_size])
        keep_rows = int(tokens.rows * limit / total)
        lines = [
            f"OUTPUT TOO LARGE: {total / TB:,.1f} TB, above --warn-output-tb {args.warn_output_tb:g} TB "
            f"({plan['storage']['dollars_per_month']:,.0f} $/month to keep). To shrink it:",
            f"  - fewer layers or sites: each of the {len(outputs)} ({', '.join(map(output_key, outputs))}) is "
            f"{per_output / TB:,.1f} TB" + (" (mlp_hidden: intermediate/hidden times that)" if any(
                config.width(o) != config.hidden_size for o in outputs) else ""),
            f"  - fewer rows: about {keep_rows:,} of {tokens.rows:,} rows fit under the threshold",
        ]
        for shorter in (512, 256, 128):
            cut = tokens.truncated(shorter) if shorter < job.max_seq_len else None
            if cut is not None:
                lines.append(
                    f"  - a token subsample: max_seq_len {shorter} keeps {cut.tokens_per_row:,.0f} tokens/row, "
                    f"{total * cut.tokens_per_row / tokens.tokens_per_row / TB:,.1f} TB"
                )
                break
        else:
            lines.append("  - a token subsample: a smaller max_seq_len stores fewer tokens per long document")
        if fits_warning is not None and fits_warning < job.sampling.fraction:
            lines.append(f"  - token_sample {fits_warning:g}: stores that fraction of every document's positions, so "
                         "every document still contributes (--storage-budget-tb TB says what a rate keeps)")
        lines.append(dtype_advice(job, costmodel.output_widths(config, outputs), plan["sampling"]["stored_tokens"], total))
        out.append("\n".join(lines))
    shard = plan["output"]["shard_bytes"]
    if shard > SHARD_WARN_BYTES:
        if plan["output"]["shard_cut_by"] == "shard_bytes":
            remedy = f"shard_bytes is {job.shard_bytes:,}; shard_bytes {2**30} gives about 1 GiB"
        else:
            per_row = shard / max(1, plan["output"]["shard_rows"])
            remedy = f"shard_size {max(1, int(2**30 // per_row))} gives about 1 GiB"
        out.append(
            f"shards of ~{_si(shard, 'B')}: each is encoded and uploaded from host memory whole (extract/writer.py); "
            + remedy
        )
    if not tokens.sampled_rows:
        out.append(
            "tokens per row were given, not measured: attention FLOPs assume every row has the mean length "
            "(they are higher when lengths vary)"
        )
    if plan["accelerator"]["hosts"] > 1:
        out.append(
            f"{plan['accelerator']['name']} is a multi-host slice ({plan['accelerator']['hosts']} hosts); fleet/specs.py "
            "launches single-host types only"
        )
    age = (datetime.date.today() - datetime.date.fromisoformat(prices.as_of)).days
    if age > 180:
        out.append(f"the price table is {age} days old (as_of {prices.as_of}); refresh {prices.source}")
    if plan["accelerator"]["platform"] == "cpu":
        out.append(f"{plan['accelerator']['name']}: the peak is {plan['accelerator']['peak_source']}; hours and $ rest "
                   "on it and on --mfu (measure a task with bench/goodput_bench.py and pass --mfu)")
    name = plan["accelerator"]["name"]  # `cpu` is the table's first CPU machine type
    out += [note for note in (prices.unconfirmed(name), prices.unconfirmed_storage(args.storage)) if note]
    return out


def dtype_advice(job, widths, stored_tokens: float, total: float) -> str:
    """The output-too-large remedy a dtype offers: the output's size in each smaller stored dtype
    (extract/job.py OUT_DTYPES). Only the activations change: fp32 stores 4 bytes a value, bf16 and
    fp16 2, fp8 1 and a float32 scale per token and output (docs/EXTRACTION.md, "Compact storage: fp8")."""
    now = costmodel.value_bytes_per_token(job, widths)

    def size(dtype: str) -> str:
        other = costmodel.value_bytes_per_token(job.model_copy(update={"dtype": dtype}), widths)
        return f"{(total + stored_tokens * (other - now)) / TB:,.1f} TB"

    fp8 = (f"fp8: about {size('fp8')} (1 byte a value and a 4-byte scale per token and output; an SAE trained on it "
           "came within 0.005 explained variance of one trained on bf16: docs/EXTRACTION.md, \"Compact storage: fp8\")")  # fmt: skip
    if job.dtype == "fp32":
        return f"  - dtype {fp8}; bf16 or fp16: about {size('bf16')} (2 bytes a value; fp32 stores 4)"
    if job.dtype == "fp8":
        return (f"  - dtype: fp8 is already the smallest stored dtype (1 byte a value and a 4-byte scale per token and "
                f"output); bf16 or fp16 would take about {size('bf16')}")  # fmt: skip
    return f"  - dtype {fp8}, about half; fp16 is the same size as bf16 (2 bytes a value)"


def ledgers_of(queue: str | None) -> dict | None:
    """What the done markers of `queue` say of their consumers' phases (reporting.goodput.summary: fixed seconds an
    attempt, over how many attempts), with the queue's URL; None without a queue, or one whose markers report no
    phases yet (or that cannot be read: the plan then uses the assumed figures, and says so)."""
    if not queue:
        return None
    import objectstore
    from reporting.status import snapshot

    try:
        goodput = snapshot(objectstore.open_store(queue))["goodput"]
    except (objectstore.StoreError, OSError) as err:
        log.warning("event=ledgers_unread queue=%s error=%s", queue, err)
        return None
    if not goodput or goodput["fixed_s_per_attempt"] is None:
        return None
    return {**goodput, "queue": queue}


def task_fixed_seconds(job: Job, config, depth: int, machine: pricing.Accelerator, prices: pricing.PriceTable,
                       given: float | None = None, measured: dict | None = None) -> dict:  # fmt: skip
    """A task's fixed seconds on `machine`, for the job's programs (one per bucket, at most): `given`
    (--fixed-seconds) if there is one; else the ledgers of earlier done markers of the run's queue (`measured`,
    `ledgers_of`: the mean fixed seconds of an attempt, first tasks' copies and compiles included, on the machines
    that ran them, which are the queue's fleet: the run's own accelerator); else the platform's figures
    (extract/costmodel.py, STARTUP_COSTS: labelled assumptions until a device of the platform measured them)."""
    platform = machine.platform
    compute_bytes = {"bf16": 2, "fp32": 4}[job.compute_dtype]
    startup = costmodel.STARTUP_COSTS[platform]
    fixed = {"platform": platform, **costmodel.task_fixed_seconds(startup, config, depth, len(job.buckets), compute_bytes)}
    if given is not None:
        fixed.update(warm_s=given, source="given (--fixed-seconds)", assumed=False)
    elif measured is not None:
        fixed.update(warm_s=measured["fixed_s_per_attempt"], first_task_extra_s=0.0, assumed=False,
                     source=f"measured: the ledgers of {measured['attempts']} attempts' done markers in "
                            f"{measured['queue']} (their mean fixed seconds, first tasks' copies and compiles "
                            "included)")  # fmt: skip
    return fixed


def fixed_machine_hours(fixed: dict, tasks: int, machines: int) -> float:
    """Machine-hours of the fixed seconds (`task_fixed_seconds`): every task's warm start and tail, and each
    machine's first task's copy and compiles."""
    return (tasks * fixed["warm_s"] + min(tasks, machines) * fixed["first_task_extra_s"]) / 3600
