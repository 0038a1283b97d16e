"""The flags of a job planned alone (`gcs-spawner plan JOB --accelerator TYPE`), argparse only: the `plan` verb's
parser is built for `--help` too, which must import nothing heavy (reporting.plan reads them: `job_inputs`)."""

from __future__ import annotations

import argparse

#: The flags of `gcs-spawner plan JOB --accelerator TYPE` (a job alone), by PlanInputs field; a run file's plan
#: takes them from the run file instead.
JOB_FLAGS = ("accelerator", "tasks", "rows", "tokens_per_row", "stats", "sample_rows", "model_config", "tokenizer",
             "mfu", "machines", "target_minutes", "fixed_seconds", "heartbeat", "storage", "months",
             "warn_output_tb", "storage_budget_tb", "queue")  # fmt: skip


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that plan a job alone (`JOB_FLAGS`), added to the `plan` verb's parser (gcs_spawner/cli.py)."""
    p.add_argument("--accelerator", help="plan a job file alone on this TPU type (v5litepod-8, v6e-8, v4-8, v5p-8), GPU "
                   "machine type or cpu; the flags below are for that mode")  # fmt: skip
    p.add_argument("--tasks", help="tasks.jsonl from gcs-spawner tasks: rows and task sizes come from it")
    p.add_argument("--rows", type=int, help="rows in the job (instead of tasks or footers)")
    p.add_argument("--tokens-per-row", type=float, help="mean stored tokens per row (instead of a tokenised sample)")
    p.add_argument("--stats", help='JSON file {"rows": N, "tokens_per_row": X, "source": "..."} instead of the flags')
    p.add_argument("--sample-rows", type=int, default=1024, help="rows to tokenise for tokens per row (default 1024)")
    p.add_argument("--model-config", help="the model's config.json, when the job's model is not a local directory")
    p.add_argument("--tokenizer", help="a directory with the model's tokenizer, when the model is not local")
    p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation (default 0.35)")
    p.add_argument("--count", dest="machines", type=int, default=32,
                   help="machines in the fleet, for the wall-clock time (default 32)")
    p.add_argument("--machines", dest="machines", type=int, help=argparse.SUPPRESS)  # the old name of --count
    p.add_argument("--target-minutes", type=float, default=10.0, help="task length to aim for (default 10)")
    p.add_argument("--fixed-seconds", type=float, help="a task's fixed seconds on a warm machine, measured (status's "
                   "goodput line); default: --queue's ledgers, else the platform's figure")  # fmt: skip
    p.add_argument("--heartbeat", type=float, default=30.0, help="spawn.py --heartbeat seconds (default 30)")
    p.add_argument("--storage", default="region", help="bucket location class in the price table (default region)")
    p.add_argument("--months", type=float, default=1.0, help="months the output is kept, for storage $ (default 1)")
    p.add_argument("--warn-output-tb", type=float, default=10.0, help="warn above this many TB of output (default 10)")
    p.add_argument("--storage-budget-tb", type=float, help="suggest the token_sample whose output fits this many TB")
    p.add_argument("--queue", help="a queue (gs://B/jobs/J or a directory) whose done markers' ledgers give the fixed "
                   "seconds a task (default: the platform's assumed figures)")  # fmt: skip
