"""Where a task's seconds go, cold and warm: a sequence of real consume.py tasks on one machine, phase by phase.

A checkpoint of a released model's shape (Qwen2.5-0.5B by default) with random bf16 weights is written once and
served as a `gs://` model by the fake GCS server (tests/fakegcs, over HTTP on 127.0.0.1), so the first task reads
the bucket by ranged reads as a fleet machine would. Then `--tasks` tasks of `--rows` documents each run one after
another as `consume.py` processes with the default settings and a fresh cache directory ($XDG_CACHE_HOME): the
first is cold (nothing cached), the others warm (the compilation cache and the weights copy of the first). Beside
them, `--baseline` tasks run with both caches off (EXTRACT_COMPILE_CACHE=off, EXTRACT_WEIGHTS_CACHE=off), as every
task ran before them. Then `--resident` tasks run on one resident consume.py (docs/PROTOCOL.md, "Resident
consumers") with a fresh cache of its own: its first task cold, the others warm, with its engine kept loaded.

Each column is read from what the queue would get: the phase counters of the task's progress records (summed as
the done marker sums them, extract/phases.py), and the consumer's log lines for each compiled program. A task
computes `--layers` decoder layers of the shape (the whole checkpoint is written and copied, only those layers
are read and computed: a full 24-layer step is too slow for a 2-core machine).

    .venv/bin/python bench/goodput_bench.py                       # Qwen2.5-0.5B shape, 4 layers, 3 tasks + 2 off + 3 resident
    .venv/bin/python bench/goodput_bench.py --rows 64 --max-seq-len 512 --layers 2 --tasks 2 --baseline 0 --resident 2
    python3 bench/goodput_bench.py --shape Qwen/Qwen2.5-7B --checkpoint-layers 18 --layers 18 --source local \\
        --rows 64 --max-seq-len 2048 --batch-size 8 --packing --tasks 2 --baseline 0   # bench/accelerator_run.sh
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from extract.costmodel import KNOWN_CONFIGS  # noqa: E402
from extract.phases import ATTEMPTS, PHASES, counter_name, summarize  # noqa: E402
from extract.tiny import generate_text, write_tiny_tokenizer  # noqa: E402

_PROGRAM = re.compile(r"event=program seq_len=(\d+) packed=(\w+) compile_s=([\d.]+) persistent_cache=(\w+)")
_COMPILE = re.compile(r"event=compile seq_len=(\d+).* lower_s=([\d.]+) compile_s=([\d.]+)")
_WEIGHTS = re.compile(r"event=weights_cache .*reused=(\d+) copied=(\d+) rebuilt=(\d+) seconds=([\d.]+)")


def write_checkpoint(directory: pathlib.Path, config: dict, seed: int = 0) -> int:
    """A safetensors checkpoint of `config`'s shape in bf16, written tensor by tensor (the host never holds the
    model); returns its bytes. The layout is safetensors': an 8-byte header length, a JSON header, the raw
    little-endian data. Each tensor tiles one block of random values (scaled by its fan-in): a 7B-shaped
    checkpoint is written in seconds, and the figures here are times, not numerics."""
    block = np.random.default_rng(seed).standard_normal(1 << 22, dtype=np.float32)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.q_proj.bias": (heads * head_dim,),
                   p + "self_attn.k_proj.weight": (kv * head_dim, hidden), p + "self_attn.k_proj.bias": (kv * head_dim,),
                   p + "self_attn.v_proj.weight": (kv * head_dim, hidden), p + "self_attn.v_proj.bias": (kv * head_dim,),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim), p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter)}  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            scale = 0.1 if len(shape) == 1 else 1 / np.sqrt(shape[-1])
            values = np.resize(block, shape) * scale + (1.0 if len(shape) == 1 else 0.0)
            f.write(values.astype(ml_dtypes.bfloat16).tobytes())
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return offset


def write_documents(path: pathlib.Path, rows: int, seed: int) -> pathlib.Path:
    """JSON Lines of generated prose of log-normal lengths (median 250 words, 5 to 2,000), so that unpacked tasks
    meet several buckets; no pyarrow needed, so the same command runs on an accelerator host's own image."""
    rng = random.Random(seed)
    words = (int(min(2000, max(5, rng.lognormvariate(math.log(250), 0.9)))) for _ in range(rows))
    lines = (json.dumps({"text": generate_text(rng, n)}) + "\n" for n in words)
    path.write_text("".join(lines))
    return path


def run_task(root: pathlib.Path, name: str, job_file: pathlib.Path, task: dict, env: dict) -> dict:
    """One consume.py process; its phases (from its progress records' counters), programs and wall time."""
    work = root / name
    work.mkdir()
    (work / "task.json").write_text(json.dumps(task))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "consume.py"), "--job-file", str(job_file), "--task-file", str(work / "task.json"),
         "--output", str(work / "out"), "--progress-file", str(work / "progress.jsonl")],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: consume.py exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return phases_of(name, read_counters(work / "progress.jsonl"), proc.stderr, elapsed)


def phases_of(name: str, counters: dict[str, int], log_text: str, elapsed: float) -> dict:
    """One task's phases (its progress records' counters), programs and weights copy (its log), and process time."""
    seconds = {phase: counters.get(counter_name(phase), 0) / 1000 for phase in PHASES}
    lowering = {int(m[1]): (float(m[2]), float(m[3])) for m in _COMPILE.finditer(log_text)}
    programs = [{"seq_len": int(m[1]), "seconds": float(m[3]), "cache": m[4],
                 "lower_s": lowering.get(int(m[1]), (None, None))[0], "xla_s": lowering.get(int(m[1]), (None, None))[1]}
                for m in _PROGRAM.finditer(log_text)]  # fmt: skip
    weights = _WEIGHTS.search(log_text)
    copy = None if weights is None else {"reused": int(weights[1]), "copied": int(weights[2])}
    return {"name": name, "process_s": elapsed, "attempts": counters.get(ATTEMPTS, 0), **summarize(seconds),
            "programs": programs, "weights_cache": copy}  # fmt: skip


def read_counters(progress: pathlib.Path) -> dict[str, int]:
    counters: dict[str, int] = {}
    for line in progress.read_text().splitlines():
        for key, value in json.loads(line).get("counters", {}).items():
            counters[key] = counters.get(key, 0) + value
    return counters


def run_resident(
    root: pathlib.Path, names: list[str], job_file: pathlib.Path, tasks: list[dict], env: dict
) -> list[dict]:
    """The same tasks on one resident consume.py (SPAWN_RESIDENT=1), driven over its standard input and output as
    `spawn.py --resident` drives it (docs/PROTOCOL.md, "Resident consumers"): each task's phases from its progress
    records, its `process` seconds from the request to the reply; the process's exit after end of input is timed."""
    log_path = root / "resident.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "consume.py")], cwd=REPO, env={**env, "SPAWN_RESIDENT": "1"},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
    results = []
    try:
        for name, task in zip(names, tasks):
            work = root / name
            work.mkdir()
            (work / "task.json").write_text(json.dumps(task))
            variables = {"SPAWN_TASK_FILE": str(work / "task.json"), "SPAWN_JOB_FILE": str(job_file),
                         "SPAWN_OUTPUT": str(work / "out"), "SPAWN_PROGRESS_FILE": str(work / "progress.jsonl"),
                         "SPAWN_TASK_ID": task["id"], "SPAWN_ATTEMPT": "1"}  # fmt: skip
            before = log_path.stat().st_size
            started = time.monotonic()
            proc.stdin.write((json.dumps({"task": task["id"], "env": variables, "waited_s": 0.0}) + "\n").encode())
            proc.stdin.flush()
            reply = json.loads(proc.stdout.readline() or "null")
            elapsed = time.monotonic() - started
            if not reply or reply["exit_code"] != 0:
                raise RuntimeError(f"{name}: the resident consume.py replied {reply}:\n{log_path.read_text()[-4000:]}")
            with open(log_path, encoding="utf-8", errors="replace") as f:
                f.seek(before)
                text = f.read()
            results.append(phases_of(name, read_counters(work / "progress.jsonl"), text, elapsed))
            print(f"  {name}: wall {results[-1]['wall_s']:.1f} s", flush=True)
        proc.stdin.close()
        started = time.monotonic()
        proc.wait(timeout=120)
        results[-1]["exit_s"] = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return results


def weights_side_by_side(url: str, cache_root: pathlib.Path, layers: int, reps: int = 3) -> list[tuple[float, float]]:
    """Seconds to read the embedding and the first `layers` layers' tensors into host memory, in place from the
    bucket (ranged reads) and from this machine's copy (made by the tasks above), interleaved `reps` times."""
    from extract import weightcache
    from extract.weights import Checkpoint

    def read(checkpoint: Checkpoint) -> float:
        started = time.monotonic()
        wanted = ("model.embed_tokens.", *(f"model.layers.{i}." for i in range(layers)))
        for name in [n for n in checkpoint.tensors if n.startswith(wanted)]:
            np.array(checkpoint.read(name), copy=True)  # a copy: every page is read
        checkpoint.close()
        return time.monotonic() - started

    return [(read(Checkpoint.from_store(url)), read(weightcache.open_checkpoint(url, cache_root)))
            for _ in range(reps)]


def table(results: list[dict]) -> str:
    names = [r["name"] for r in results]
    width = max(12, *(len(n) + 2 for n in names))
    lines = ["phase (s)".ljust(14) + "".join(n.rjust(width) for n in names)]
    for phase in PHASES:
        lines.append(phase.ljust(14) + "".join(f"{r['phases'][phase]:{width}.2f}" for r in results))
    lines.append("fixed".ljust(14) + "".join(f"{r['fixed_s']:{width}.2f}" for r in results))
    lines.append("wall".ljust(14) + "".join(f"{r['wall_s']:{width}.2f}" for r in results))
    lines.append("goodput".ljust(14) + "".join(f"{r['goodput']:{width}.1%}" for r in results))
    lines.append("process".ljust(14) + "".join(f"{r['process_s']:{width}.2f}" for r in results))
    lines.append("  programs: seq_len: trace + compile seconds, and the persistent cache's answer")
    for r in results:
        shown = ", ".join(f"{p['seq_len']}: {p['lower_s'] or 0:.2f} + {p['seconds']:.2f} {p['cache']}"
                          for p in r["programs"]) or "none (kept loaded)"  # fmt: skip
        kept = r["name"].startswith("res-warm")
        weights = r["weights_cache"] or ("kept loaded" if kept else "read in place")
        lines.append(f"  {r['name']}: {shown}; weights {weights}")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """The figures issue 44 asks for: per-task and resident side by side, warm tasks' fixed seconds and goodput, and
    the seconds a process spends outside its ledger (its start before, its teardown after; a resident task's
    request-to-reply time less its ledger)."""
    lines = []
    for label, prefix in (("per-task", "warm"), ("resident", "res-warm")):
        warm = [r for r in results if r["name"].startswith(prefix)]
        if not warm:
            continue
        fixed = sorted(r["fixed_s"] for r in warm)
        outside = sorted(r["process_s"] - r["wall_s"] for r in warm)
        steady, wall = sum(r["phases"]["steady"] for r in warm), sum(r["wall_s"] for r in warm)
        process = sum(r["process_s"] for r in warm)
        lines.append(f"{label} warm tasks ({len(warm)}): fixed s median {fixed[len(fixed) // 2]:.2f}, goodput "
                     f"{steady / wall:.1%} (steady over ledger), {steady / process:.1%} (steady over process seconds); "
                     f"seconds outside the ledger median {outside[len(outside) // 2]:.2f}")  # fmt: skip
    resident = [r for r in results if "exit_s" in r]
    if resident:
        lines.append(f"resident consumer's exit after end of input: {resident[0]['exit_s']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Qwen/Qwen2.5-0.5B", choices=sorted(KNOWN_CONFIGS), help="a config of costmodel")
    p.add_argument("--layers", type=int, default=4, help="decoder layers computed (the hidden state kept)")
    p.add_argument("--checkpoint-layers", type=int, help="layers written to the checkpoint (default: the shape's)")
    p.add_argument("--tasks", type=int, default=3, help="tasks with the caches on: the first cold, the rest warm")
    p.add_argument("--baseline", type=int, default=2, help="tasks with both caches off")
    p.add_argument("--resident", type=int, default=3,
                   help="tasks on one resident consume.py (its own fresh cache): the first cold, the rest warm")
    p.add_argument("--rows", type=int, default=16, help="documents per task")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--packing", action="store_true", help="pack documents into rows (job.packing)")
    p.add_argument("--source", choices=("gcs", "local"), default="gcs",
                   help="gcs: the model on the fake GCS server as gs:// (the weights cache works); local: a directory")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = p.parse_args(argv)

    config = dict(KNOWN_CONFIGS[args.shape])
    config["num_hidden_layers"] = args.checkpoint_layers or config["num_hidden_layers"]
    if not 1 <= args.layers <= config["num_hidden_layers"]:
        p.error(f"--layers {args.layers}: use 1..{config['num_hidden_layers']} (the checkpoint's layers)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPAWN_", "JAX_COMPILATION_CACHE", "EXTRACT_"))}
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as scratch, contextlib.ExitStack() as stack:
        root = pathlib.Path(scratch)
        started = time.monotonic()
        model_dir = root / "model"
        size = write_checkpoint(model_dir, config)
        write_tiny_tokenizer(model_dir, vocab=4096, seed=0, model_max_length=args.max_seq_len)
        rows = args.rows * (args.tasks + args.baseline + args.resident)
        data_file = write_documents(root / "data.jsonl", rows, seed=1)
        model = str(model_dir)
        if args.source == "gcs":
            from bench.host_bench import fake_gcs_server  # the fake GCS server in its own process, bucket `bench`
            from extract.weights import upload_model_dir

            env["STORAGE_EMULATOR_HOST"] = os.environ["STORAGE_EMULATOR_HOST"] = stack.enter_context(fake_gcs_server())
            model = "gs://bench/model"
            upload_model_dir(model_dir, model)
        job = {"data_files": [str(data_file)], "model": model, "layers": [args.layers], "max_seq_len": args.max_seq_len,
               "batch_size": args.batch_size, "shard_size": args.rows, "packing": args.packing}  # fmt: skip
        job_file = root / "job.json"
        job_file.write_text(json.dumps(job))
        print(f"setup: {args.shape} shape ({config['num_hidden_layers']} layers, {size / 1e9:.2f} GB bf16 checkpoint "
              f"from {args.source}), {args.layers} layers computed, {args.rows} documents a task, max_seq_len "
              f"{args.max_seq_len}, batch {args.batch_size}, packing {args.packing}; written in "
              f"{time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip

        def task(k: int) -> dict:
            return {"id": f"t{k}", "files": [{"path": str(data_file), "base": 0, "start": k * args.rows,
                                               "end": (k + 1) * args.rows}]}  # fmt: skip

        results = []
        cached = {**env, "XDG_CACHE_HOME": str(root / "cache")}
        for k in range(args.tasks):
            results.append(run_task(root, "cold" if k == 0 else f"warm{k}", job_file, task(k), cached))
            print(f"  {results[-1]['name']}: wall {results[-1]['wall_s']:.1f} s", flush=True)
        off = {**env, "XDG_CACHE_HOME": str(root / "cache-off"), "EXTRACT_COMPILE_CACHE": "off",
               "EXTRACT_WEIGHTS_CACHE": "off"}  # fmt: skip
        for k in range(args.baseline):
            results.append(run_task(root, f"off{k + 1}", job_file, task(args.tasks + k), off))
            print(f"  {results[-1]['name']}: wall {results[-1]['wall_s']:.1f} s", flush=True)
        first = args.tasks + args.baseline
        if args.resident:
            resident_env = {**env, "XDG_CACHE_HOME": str(root / "cache-resident")}
            names = ["res-cold", *(f"res-warm{k}" for k in range(1, args.resident))]
            results += run_resident(root, names, job_file, [task(first + k) for k in range(args.resident)], resident_env)
        side = []
        if args.source == "gcs" and args.tasks:
            side = weights_side_by_side(model, root / "cache" / "gcs-spawner" / "weights", args.layers)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        print(table(results))
        for in_place, copy in side:
            print(f"  weights read side by side: in place {in_place:.2f} s, from the machine's copy {copy:.2f} s")
        print(summary(results))
        if args.json:
            print(json.dumps({"shape": args.shape, "layers": args.layers, "source": args.source, "results": results,
                              "weights_side_by_side": side}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
