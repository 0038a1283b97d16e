#!/usr/bin/env python3
"""The whole pipeline on one machine, with a local directory as the bucket (what `make run` does).

1. a model: a small random Qwen2 checkpoint with a tokenizer trained on the spot (or $MODEL);
2. a dataset: local parquet files with FineWeb-Edu's columns (or $DATASET / $DATA_FILES);
3. tasks planned by tools/make_tasks.py and submitted by tools/submit.py to a local queue;
4. $WORKERS spawn.py workers (default 3) in parallel, each with one resident consume.py serving its tasks;
5. tools/status.py (and its page, local-run/status.html), then tools/merge.py;
6. the activations read back through the reader API, with their shapes and counts;
7. the training loader's first shuffled batch (docs/TRAINING.md);
8. with $SITES, the first hook site exported for SAELens (tools/export.py).

Every step is the same command a user runs by hand; they are printed as they run. Point it at a
real model and dataset with environment variables, e.g.
    MODEL=Qwen/Qwen2.5-0.5B DATASET=HuggingFaceFW/fineweb-edu DATASET_CONFIG=sample-10BT MAX_ROWS=2000 make run
(the Hub must then be reachable). Hook sites to keep besides the hidden states of $LAYERS:
    SITES="mlp_out:1,2;attn_out:1" make run
(site:decoder layers from 0, ';' between sites; docs/EXTRACTION.md, "Hook sites"). Everything lands in
./local-run/, which each run starts afresh.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
WORK = pathlib.Path(os.environ.get("LOCAL_RUN_DIR", REPO / "local-run"))


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def sh(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run one of the project's own commands, showing it as a user would type it."""
    shown = [("python" if a == sys.executable else a) for a in args]
    print("$ " + shlex.join(shown), flush=True)
    return subprocess.run([*args], cwd=REPO, check=True, **kwargs)


def build_model() -> str:
    if os.environ.get("MODEL"):
        return os.environ["MODEL"]
    from extract.tiny import write_tiny_qwen

    directory = write_tiny_qwen(WORK / "model", model_type="qwen2", hidden=128, layers=4, heads=4, kv_heads=2, vocab=512)
    print(f"wrote a random Qwen2 checkpoint (hidden 128, 4 layers, GQA 4/2) and a trained tokenizer to {directory}")
    return str(directory)


def dataset_fields() -> dict:
    if os.environ.get("DATASET"):
        return {"dataset": {"name": env("DATASET", ""), "config": os.environ.get("DATASET_CONFIG"), "split": env("DATASET_SPLIT", "train")}}
    if os.environ.get("DATA_FILES"):
        return {"data_files": os.environ["DATA_FILES"].split(",")}
    from extract.tiny import write_fineweb_like_parquet

    paths = write_fineweb_like_parquet(WORK / "data", n_files=3, rows_per_file=[130, 90, 100], seed=1)
    print(f"wrote {len(paths)} parquet files with FineWeb-Edu's columns to {WORK / 'data'}")
    return {"data_files": [str(p) for p in paths]}


def sites_field() -> dict:
    """$SITES ("mlp_out:1,2;attn_out:1") as the job's `sites`, or nothing."""
    spec = os.environ.get("SITES", "").strip()
    if not spec:
        return {}
    sites = {}
    for part in spec.split(";"):
        site, _, layers = part.partition(":")
        sites[site.strip()] = [int(x) for x in layers.split(",")]
    return {"sites": sites}


def main() -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    queue = env("QUEUE", str(WORK / "queue"))
    workers = int(env("WORKERS", "3"))

    step("1-2. model and dataset")
    job = {
        "model": build_model(),
        **dataset_fields(),
        "text_field": env("TEXT_FIELD", "text"),
        "layers": [int(x) for x in env("LAYERS", "1,2,-1").split(",")],
        **sites_field(),
        "max_seq_len": int(env("MAX_SEQ_LEN", "128")),
        "batch_size": int(env("BATCH_SIZE", "8")),
        "dtype": env("DTYPE", "bf16"),
        "shard_size": int(env("SHARD_SIZE", "32")),
    }
    if os.environ.get("TOKEN_SAMPLE"):  # store a fraction of each document's positions (docs/EXTRACTION.md)
        job["token_sample"] = float(os.environ["TOKEN_SAMPLE"])
    if os.environ.get("DROP_FIRST"):
        job["drop_first"] = int(os.environ["DROP_FIRST"])
    job_file = WORK / "job.json"
    job_file.write_text(json.dumps(job, indent=1) + "\n")
    print(f"job: {json.dumps(job)}")

    step("3. plan and submit the tasks")
    tasks_file = WORK / "tasks.jsonl"
    sh(sys.executable, "tools/make_tasks.py", str(job_file), "--rows-per-task", env("ROWS_PER_TASK", "40"), "-o", str(tasks_file))
    max_rows = os.environ.get("MAX_ROWS")
    if max_rows:  # keep a real dataset's run small: only the tasks covering the first MAX_ROWS rows
        kept, rows = [], 0
        for line in tasks_file.read_text().splitlines():
            if rows >= int(max_rows):
                break
            kept.append(line)
            rows += sum(f["end"] - f["start"] for f in json.loads(line)["files"])
        tasks_file.write_text("\n".join(kept) + "\n")
    if not queue.startswith("gs://"):
        pathlib.Path(queue).mkdir(parents=True, exist_ok=True)  # a local queue is a directory that exists
    sh(sys.executable, "tools/submit.py", queue, "--job", str(job_file), "--tasks", str(tasks_file))

    step(f"4. {workers} workers drain the queue, each with one resident consume.py for its tasks")
    logs = WORK / "logs"
    logs.mkdir()
    spawn = [sys.executable, "spawn.py", queue, "--consumer", "python consume.py", "--resident", "--lease-ttl", "60",
             "--idle-timeout", "20"]
    print("$ " + shlex.join(["python", *spawn[1:]]) + f"   (x{workers}, logs in {logs})", flush=True)
    procs = []
    for k in range(workers):
        log = open(logs / f"worker-{k}.log", "wb")
        procs.append(subprocess.Popen([*spawn, "--worker-id", f"local-{k}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    started = time.monotonic()
    while any(p.poll() is None for p in procs):
        time.sleep(5)
        status = subprocess.run(
            [sys.executable, "tools/status.py", queue, "--json"], cwd=REPO, capture_output=True, text=True
        )
        if status.returncode == 0:
            view = json.loads(status.stdout)
            print(
                f"  {time.monotonic() - started:5.0f}s  done {view['done']}/{view['total']}  "
                f"leased {view['leased']}  failed {view['failed']}",
                flush=True,
            )
    failed_workers = [k for k, p in enumerate(procs) if p.returncode != 0]
    if failed_workers:
        print(f"workers {failed_workers} exited non-zero; see {logs}", file=sys.stderr)
        return 1

    step("5. status and merge")
    sh(sys.executable, "tools/status.py", queue, "--html", str(WORK / "status.html"))
    print(f"status page: {WORK / 'status.html'}")
    sh(sys.executable, "tools/merge.py", queue)

    step("6. read the activations back")
    from activations.format import output_key
    from activations.reader import open_activations
    from objectstore import open_store
    from reporting.goodput import render_goodput, split_counters, summary
    from taskqueue import layout

    store = open_store(queue)
    samples = tokens = 0
    for k, entry in enumerate(store.list(layout.DONE)):
        acts = open_activations(store.url(entry.name))
        samples += acts.num_samples
        tokens += acts.num_tokens
        if k == 0:  # show one sample's arrays; count them all
            first = next(acts.samples())
            print(f"task {layout.id_from_object(entry.name, layout.DONE)}: {acts.num_samples} samples, layers "
                  f"{acts.layers}, sites {acts.sites}")
            for name, array in [("token_ids", first.token_ids)] + [(output_key(o), a) for o, a in first.outputs.items()]:
                print(f"  sample {first.sample_id}: {name:12s} shape {tuple(array.shape)} dtype {array.dtype}")
    index = json.loads(store.read("index.json").data)
    totals, phases = split_counters(index["totals"])
    print(f"read back {samples} samples, {tokens} tokens from {index['totals']['shards']} shards "
          f"({index['totals']['bytes'] / 1e6:.1f} MB); index totals: {json.dumps(totals)}")
    print(*render_goodput(summary(phases)), sep="\n")
    if "processed_tokens" in index["totals"]:
        print(f"sampled: {index['totals']['stored_tokens']} tokens stored of {index['totals']['processed_tokens']} "
              f"processed (job token_sample={job.get('token_sample', 1)}, drop_first={job.get('drop_first', 0)})")

    step("7. the training loader (docs/TRAINING.md)")
    from activations.loader import ActivationLoader

    layer = acts.layers[0]
    normalize = "mean_norm" if index.get("stats") else None  # statistics of shards written before them are absent
    print(f"ActivationLoader({queue!r}, layers={layer}, batch_size=256, shuffle_tokens=4096, normalize={normalize!r})")
    with ActivationLoader(queue, layers=layer, batch_size=256, shuffle_tokens=4096, normalize=normalize) as loader:
        batch = next(loader)
    print(f"first batch: shape {tuple(batch.shape)} dtype {batch.dtype}")
    for site, layers in acts.sites.items():
        print(f"ActivationLoader({queue!r}, site={site!r}, layers={list(layers)}, batch_size=256, shuffle_tokens=4096)")
        with ActivationLoader(queue, site=site, layers=list(layers), batch_size=256, shuffle_tokens=4096) as loader:
            batch = next(loader)
        print(f"first batch: shape {tuple(batch.shape)} dtype {batch.dtype}")

    if acts.sites:
        site, layers = next(iter(acts.sites.items()))
        step(f"8. {site} of layer {layers[0]} for SAELens (docs/TRAINING.md)")
        sh(sys.executable, "tools/export.py", queue, "--format", "saelens", str(WORK / "saelens"), "--site", site,
           "--layer", str(layers[0]), "--context-size", "16")
    return 0


def parse_args(argv: list[str]) -> None:
    """No arguments, only the environment variables above: --help prints them and exits before anything runs; any
    other argument is a usage error (exit 2), not a reason to start the pipeline."""
    import argparse

    parser = argparse.ArgumentParser(prog="tools/local_run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)


if __name__ == "__main__":
    parse_args(sys.argv[1:])
    sys.exit(main())
