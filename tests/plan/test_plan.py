"""The planner (tools/plan.py, extract/costmodel.py, reporting/pricing.py) against figures worked out by hand.

The by-hand figures are written out from the formulas in docs/MODEL.md and docs/EXTRACTION.md, not copied from
the code's output, so a change in what the code counts fails here.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from extract import costmodel
from extract.config import ModelConfig
from extract.errors import BadInput
from extract.job import Job
from extract.tiny import tiny_qwen_config, write_fineweb_like_parquet, write_tiny_qwen
from reporting import pricing

REPO = pathlib.Path(__file__).resolve().parents[2]

# A tiny Qwen2: D=64, N=4 query heads, K=2 KV heads, H=16, F=128, 3 layers.
TINY = tiny_qwen_config("qwen2", hidden=64, layers=3, heads=4, kv_heads=2, vocab=384, tie=False, intermediate=128)


def tiny_job(**overrides) -> Job:
    raw = {"model": "m", "data_files": ["x.parquet"], "layers": [1, 2], "max_seq_len": 32, "batch_size": 2,
           "shard_size": 4, **overrides}  # fmt: skip
    return Job.from_dict(raw)


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # tools run as scripts import this checkout, not an installed one
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# -- extraction figures -------------------------------------------------------------------------


def test_flops_per_token_matches_the_formula_worked_by_hand():
    config = ModelConfig.from_dict(TINY)
    # Per layer: projections 2*(D*N*H + 2*D*K*H + N*H*D + 3*D*F) = 2*(4096 + 4096 + 4096 + 24576) = 73728;
    # attention 4*N*H per key = 256. A 10-token sample through 2 layers: 2 * (73728 + 256*10) = 152576.
    assert costmodel.projection_flops_per_token(config) == 73728
    assert costmodel.attention_flops_per_token_per_key(config) == 256
    assert costmodel.flops_per_token(config, depth=2, seq_len=10) == 152576


def test_job_flops_is_the_sum_of_per_sample_counts():
    config = ModelConfig.from_dict(TINY)
    lengths = [0, 3, 10, 32]
    tokens = costmodel.TokenEstimate.from_lengths(rows=4, lengths=lengths, source="test")
    by_sample = sum(n * costmodel.flops_per_token(config, 3, n) for n in lengths)
    assert costmodel.job_flops(config, 3, tokens) == pytest.approx(by_sample)
    # Scaling to 4000 rows with the same length mix multiplies the FLOPs by 1000.
    scaled = costmodel.TokenEstimate.from_lengths(rows=4000, lengths=lengths, source="test")
    assert costmodel.job_flops(config, 3, scaled) == pytest.approx(1000 * by_sample)


def test_costmodel_counts_flops_as_the_engine_does(tmp_path):
    from extract.engine import Engine

    model = write_tiny_qwen(tmp_path / "m", model_type="qwen3", hidden=64, layers=3, heads=4, kv_heads=2)
    config = ModelConfig.from_file(model / "config.json")
    engine = Engine(str(model), [1, -2], batch_size=2, max_seq_len=32, compute_dtype="float32")
    layers = costmodel.computed_layers([1, -2], config.num_hidden_layers)
    assert layers == engine.layers and max(layers) == engine.num_computed_layers
    for seq_len in (1, 17, 32):
        assert costmodel.flops_per_token(config, max(layers), seq_len) == engine.flops_per_token(seq_len)


def test_output_bytes_per_token_by_dtype_and_layer_count():
    # 2 layers x hidden 64 x 2 bytes + a 4-byte token id = 260; fp16 is the same size as bf16; fp32 doubles values.
    assert costmodel.bytes_per_token(tiny_job(dtype="bf16"), [64, 64]) == 260
    assert costmodel.bytes_per_token(tiny_job(dtype="fp16"), [64, 64]) == 260
    assert costmodel.bytes_per_token(tiny_job(dtype="fp32"), [64, 64]) == 2 * 64 * 4 + 4


def test_output_bytes_match_a_real_shard_encoding():
    """Tensor bytes of the estimate equal what extract.writer.encode_safetensors writes, header aside."""
    from extract.writer import encode_safetensors, numpy_dtype

    job = tiny_job(layers=[1, 3], shard_size=3)
    lengths = [5, 0, 7]
    tokens = costmodel.TokenEstimate.from_lengths(rows=3, lengths=lengths, source="test")
    out = costmodel.output_bytes(job, [64, 64], tokens, task_rows=[3], header_bytes=0)
    n = sum(lengths)
    tensors = {
        "layer_1": np.zeros((n, 64), numpy_dtype("bfloat16")),
        "layer_3": np.zeros((n, 64), numpy_dtype("bfloat16")),
        "token_ids": np.zeros(n, np.int32),
        "sample_ids": np.zeros(3, np.int64),
        "offsets": np.zeros(4, np.int64),
    }
    payload = encode_safetensors(tensors, {})
    header_len = int.from_bytes(payload[:8], "little")
    assert out.shards == 1
    assert out.total == len(payload) - 8 - header_len


def test_shard_count_follows_shard_boundaries_within_each_task():
    job = tiny_job(shard_size=4)
    tokens = costmodel.TokenEstimate.from_mean(rows=10, tokens_per_row=2, max_seq_len=32, source="test")
    # Shards restart in every task: tasks of 6 + 4 rows write 2 + 1 shards, tasks of 5 + 5 write 2 + 2, where
    # one run of 10 rows would write ceil(10 / 4) = 3.
    assert costmodel.output_bytes(job, [64, 64], tokens, [6, 4], 0).shards == 3
    assert costmodel.output_bytes(job, [64, 64], tokens, [5, 5], 0).shards == 4


def test_a_given_mean_is_capped_at_max_seq_len():
    tokens = costmodel.TokenEstimate.from_mean(rows=10, tokens_per_row=1040, max_seq_len=512, source="test")
    assert tokens.tokens == 10 * 512 and tokens.tokens_sq_per_row == 512 * 512


def test_rows_per_task_targets_the_task_length_in_whole_shards():
    # 0.01 s a row: 600 s is 60000 rows, rounded down to whole shards of 256: 234 shards = 59904 rows.
    assert costmodel.rows_per_task_for(600, 0.01, 256) == 59904
    # Below one shard: two significant digits, rounded down (600 / 0.7 = 857.1 -> 850).
    assert costmodel.rows_per_task_for(600, 0.7, 1000) == 850
    assert costmodel.rows_per_task_for(600, 1e-9, 256, at_most=320) == 320
    assert costmodel.rows_per_task_for(600, 1e6, 256) == 1


def test_layer_out_of_range_names_layers():
    with pytest.raises(BadInput, match="layers"):
        costmodel.computed_layers([5], num_hidden_layers=3)


# -- prices ---------------------------------------------------------------------------------------


def test_shipped_price_table_is_dated_and_cites_the_pricing_pages():
    table = pricing.load_prices()
    assert table.as_of and "cloud.google.com/tpu/pricing" in table.sources["tpu"]
    assert "cloud.google.com/storage/pricing" in table.sources["storage"]
    assert "cloud.google.com/compute/gpus-pricing" in table.sources["gpu"]
    for name in ("v4-8", "v5litepod-8", "v5p-8", "v6e-8", "a3-highgpu-8g", "a2-highgpu-1g", "g2-standard-8"):
        machine = table.accelerator(name)
        assert machine.peak_flops > 0 and machine.on_demand_per_hour > machine.spot_per_hour > 0


def test_tpu_types_count_cores_or_chips_as_google_names_them():
    table = pricing.load_prices()
    v4 = table.accelerator("v4-8")  # 8 TensorCores = 4 chips
    v5e = table.accelerator("v5litepod-8")  # 8 chips
    assert (v4.chips, v4.hosts) == (4, 1) and (v5e.chips, v5e.hosts) == (8, 1)
    assert v4.on_demand_per_hour == pytest.approx(4 * table.tpu["v4"]["on_demand_per_chip_hour"])
    assert v4.peak_flops == pytest.approx(4 * 275e12)
    assert table.accelerator("v5litepod-16").hosts == 2


@pytest.mark.parametrize("name", ["v9-8", "h100", "", "v4-7"])
def test_unknown_accelerator_names_the_field(name):
    with pytest.raises(pricing.PriceError, match="accelerator"):
        pricing.load_prices().accelerator(name)


def test_malformed_price_file_names_the_field(tmp_path):
    raw = json.loads(pricing.PRICES_FILE.read_text())
    raw["tpu"]["v5e"]["on_demand_per_chip_hour"] = "cheap"
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(pricing.PriceError, match=r"tpu\.v5e\.on_demand_per_chip_hour"):
        pricing.load_prices(path)


# -- the tool -------------------------------------------------------------------------------------


def custom_prices(tmp_path: pathlib.Path) -> pathlib.Path:
    """The shipped table with round numbers: v5e $2 / $0.5 per chip-hour, storage $0.1 / GiB-month, A $0.01 / 1000."""
    raw = json.loads(pricing.PRICES_FILE.read_text())
    raw["as_of"] = datetime.date.today().isoformat()  # a fresh table: no staleness warning
    raw["tpu"]["v5e"].update(on_demand_per_chip_hour=2.0, spot_per_chip_hour=0.5, peak_bf16_tflops_per_chip=100)
    raw["storage"]["region"] = {"standard_per_gib_month": 0.1, "class_a_per_1000": 0.01, "class_b_per_1000": 0.001}
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def make_run_job(tmp_path_factory):
    """A job made as `make run` makes it (tools/local_run.py's model and data), planned by make_tasks.py."""
    work = tmp_path_factory.mktemp("make-run")
    model = write_tiny_qwen(work / "model", model_type="qwen2", hidden=128, layers=4, heads=4, kv_heads=2, vocab=512)
    paths = write_fineweb_like_parquet(work / "data", n_files=3, rows_per_file=[130, 90, 100], seed=1)
    job = {"model": str(model), "data_files": [str(p) for p in paths], "text_field": "text", "layers": [1, 2, -1],
           "max_seq_len": 128, "batch_size": 8, "dtype": "bf16", "shard_size": 32}  # fmt: skip
    job_file = work / "job.json"
    job_file.write_text(json.dumps(job))
    tasks_file = work / "tasks.jsonl"
    made = run_tool("tools/make_tasks.py", str(job_file), "--rows-per-task", "40", "-o", str(tasks_file))
    assert made.returncode == 0, made.stderr
    return work, job, job_file, tasks_file


@pytest.fixture(scope="module")
def make_run_lengths(make_run_job) -> list[int]:
    """Stored token counts of every row of the make-run job, tokenised here as the consumer does."""
    from extract.batching import Tokenizer
    from extract.data import read_slice
    from extract.job import Task

    work, job, job_file, tasks_file = make_run_job
    tasks = [Task.from_dict(json.loads(line)) for line in tasks_file.read_text().splitlines()]
    tokenizer = Tokenizer(job["model"], job["max_seq_len"])
    return [len(ids) for t in tasks for ids in tokenizer.encode([d.text for d in read_slice(t, "text")])]


def load_plan_tool():
    """The planner's module (reporting/plan.py), to render a plan in-process."""
    from reporting import plan

    return plan


def test_plan_for_a_make_run_job_matches_figures_computed_by_hand(make_run_job, make_run_lengths, tmp_path):
    work, job, job_file, tasks_file = make_run_job
    prices = custom_prices(tmp_path)
    result = run_tool("tools/plan.py", str(job_file), "--tasks", str(tasks_file), "--accelerator", "v5litepod-8",
                      "--prices", str(prices), "--mfu", "0.5", "--sample-rows", "1000", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)

    # Every row is sampled (1000 > 320), so the token count is exact.
    lengths = make_run_lengths
    assert plan["tokens"]["rows"] == 320 == len(lengths)
    assert plan["tokens"]["tokens"] == pytest.approx(sum(lengths))

    # FLOPs: hidden 128, 4 heads of 32, 2 KV heads, F = 256 (2 x hidden), layers [1, 2, 4] -> 4 layers computed.
    # P = 2*(128*4*32 + 2*128*2*32 + 4*32*128 + 3*128*256) = 2*(16384 + 16384 + 16384 + 98304) = 294912; A = 4*4*32.
    flops = sum(4 * (294912 * n + 512 * n * n) for n in lengths)
    assert plan["layers_computed"] == 4
    assert plan["compute"]["flops"] == pytest.approx(flops)

    # Time and dollars: v5litepod-8 = 8 chips x 100 TFLOP/s (the test's table) at MFU 0.5.
    hours = flops / (8 * 100e12 * 0.5) / 3600
    assert plan["time"]["machine_hours"] == pytest.approx(hours)
    assert plan["compute_dollars"]["on_demand"] == pytest.approx(hours * 8 * 2.0)
    assert plan["compute_dollars"]["spot"] == pytest.approx(hours * 8 * 0.5)

    # Output: 3 layers x 128 x 2 bytes + 4 = 772 bytes a token, 16 bytes a sample, shards of 32 rows in tasks of 40.
    assert plan["output"]["bytes_per_token"] == 772
    assert plan["output"]["shards"] == 8 * 2
    tensor_bytes = 772 * sum(lengths) + 16 * 320
    assert plan["output"]["activation_bytes"] + plan["output"]["sample_bytes"] == pytest.approx(tensor_bytes)
    assert plan["storage"]["dollars_per_month"] == pytest.approx(plan["output"]["bytes"] / 2**30 * 0.1)

    # Class A: per task a lease, a done marker and the lease's tombstone, 2 one-request shard uploads, no
    # heartbeat (the tasks take microseconds); 32 workers make 4 listings each before their first claim.
    ops = plan["operations"]
    assert ops["class_a"] == {"lease_creates": 8, "done_markers": 8, "tombstones": 8, "heartbeats": 0,
                              "shard_uploads": 16, "startup_listings": 32 * 4}  # fmt: skip
    assert ops["dollars"] == pytest.approx((3 * 8 + 16 + 128) / 1000 * 0.01)
    assert plan["warnings"] == []

    # The same plan as text names every figure.
    text = load_plan_tool().render(plan)
    for label in ("rows", "tokens", "compute", "time", "compute $", "output", "storage $", "operations", "tasks",
                  "recommend", "total $", "prices"):  # fmt: skip
        assert f"  {label} " in text, text
    assert f"--rows-per-task {plan['tasks']['recommended_rows_per_task']}" in text


def test_plan_from_footers_without_tasks_recommends_task_size(make_run_job):
    work, job, job_file, tasks_file = make_run_job
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v5litepod-8", "--tokens-per-row", "50",
                      "--target-minutes", "1e-9", "--fixed-seconds", "0", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["tokens"]["rows"] == 320 and "footers" in plan["tokens"]["rows_source"]
    # A vanishing target gives the smallest task, 1 row; the tasks are then cut at that size.
    assert plan["tasks"]["recommended_rows_per_task"] == 1 and plan["tasks"]["count"] == 320


QWEN25_7B_JOB = {
    "model": "Qwen/Qwen2.5-7B",
    "dataset": {"name": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT"},
    "layers": [15, 16, 17, 18],
    "max_seq_len": 4096,
    "batch_size": 8,
    "shard_size": 64,
}


def plan_fineweb(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(QWEN25_7B_JOB))
    return run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--rows", "9672101",
                    "--tokens-per-row", "1040", *extra)  # fmt: skip


def test_plan_for_a_fineweb_edu_sized_job_from_row_counts(tmp_path):
    result = plan_fineweb(tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    rows, per_row = 9672101, 1040
    # Qwen2.5-7B: hidden 3584; 4 layers x 3584 x 2 bytes + 4 = 28676 bytes a token (the 28.7 KB).
    assert plan["output"]["bytes_per_token"] == 4 * 3584 * 2 + 4
    assert plan["output"]["activation_bytes"] == pytest.approx(rows * per_row * 28676)
    assert 280e12 < plan["output"]["bytes"] < 295e12  # the "about 287 TB"
    # FLOPs to layer 18: P = 2*(3584*28*128 + 2*3584*4*128 + 28*128*3584 + 3*3584*18944), A = 4*28*128.
    p = 2 * (3584 * 28 * 128 + 2 * 3584 * 4 * 128 + 28 * 128 * 3584 + 3 * 3584 * 18944)
    assert plan["compute"]["flops"] == pytest.approx(18 * rows * (p * per_row + 4 * 28 * 128 * per_row**2))
    # Tasks long enough that their fixed seconds (assumed for a v6e machine, extract/costmodel.py) stay within 2%
    # of their time: longer than the 10-minute target here, by whole shards of 64 rows.
    minutes, fixed = plan["tasks"]["recommended_task_minutes"], plan["tasks"]["fixed"]
    assert fixed["min_task_minutes"] == pytest.approx(fixed["warm_s"] * 49 / 60) and fixed["min_task_minutes"] > 10
    shard_minutes = 64 * plan["time"]["seconds_per_row"] / 60
    assert fixed["min_task_minutes"] <= minutes < fixed["min_task_minutes"] + shard_minutes
    assert plan["tasks"]["recommended_rows_per_task"] % 64 == 0
    assert math.ceil(rows / plan["tasks"]["recommended_rows_per_task"]) == plan["tasks"]["count"]
    # 32 machines (the default) run the tasks in rounds of 32.
    rounds = math.ceil(plan["tasks"]["count"] / 32)
    assert plan["time"]["wall_clock_hours"] == pytest.approx(rounds * plan["tasks"]["mean_minutes"] / 60)
    # Heartbeats: about one per 30 s of a ~10-minute task.
    assert plan["operations"]["class_a"]["heartbeats"] == pytest.approx(plan["tasks"]["count"] * minutes * 2, rel=0.1)


def test_plan_for_a_gemma2_transcoder_job_counts_each_sites_width_and_depth(tmp_path):
    """MLP input and output of layer 12, the MLP's hidden activations of layer 5, no hidden states."""
    job = {"model": "google/gemma-2-2b", "data_files": ["x.parquet"], "max_seq_len": 1024, "batch_size": 8,
           "shard_size": 64, "sites": {"mlp_in": [12], "mlp_out": [12], "mlp_hidden": [5]}}  # fmt: skip
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--rows", "1000",
                      "--tokens-per-row", "500", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"]["model_type"] == "gemma2" and plan["layers"] == []
    assert plan["sites"] == {"mlp_in": [12], "mlp_hidden": [5], "mlp_out": [12]}
    # Hidden 2304 for mlp_in and mlp_out, intermediate 9216 for mlp_hidden, bf16, plus the token id.
    assert plan["output"]["bytes_per_token"] == (2 * 2304 + 9216) * 2 + 4
    # Layer 12 (counted from 0) needs 13 decoder layers. Gemma-2-2B: D 2304, N 8, K 4, H 256, F 9216.
    assert plan["layers_computed"] == 13
    p = 2 * (2304 * 8 * 256 + 2 * 2304 * 4 * 256 + 8 * 256 * 2304 + 3 * 2304 * 9216)
    assert plan["compute"]["flops"] == pytest.approx(13 * 1000 * (p * 500 + 4 * 8 * 256 * 500**2))


def test_plan_for_gpt2_and_pythia_jobs_counts_their_plain_mlp_and_refuses_a_site_pythia_lacks(tmp_path):
    """GPT-2 small as released spells its sizes n_embd, n_layer, n_head; its MLP is two matrices (no gate), 4 x 768
    wide. Pythia's attention and MLP run in parallel, so it has no resid_mid: the plan refuses it by name."""
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                                "vocab_size": 50257, "activation_function": "gelu_new"}))  # fmt: skip
    job = {"model": "openai-community/gpt2", "data_files": ["x.parquet"], "max_seq_len": 1024, "batch_size": 8,
           "shard_size": 64, "layers": [6], "sites": {"mlp_hidden": [5]}}  # fmt: skip
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    result = run_tool("tools/plan.py", str(job_file), "--model-config", str(gpt2), "--accelerator", "v6e-8",
                      "--rows", "1000", "--tokens-per-row", "500", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"]["model_type"] == "gpt2" and plan["layers_computed"] == 6
    assert plan["output"]["bytes_per_token"] == (768 + 3072) * 2 + 4  # hidden state 6 and the 3072-wide mlp_hidden
    p = 2 * (768 * 12 * 64 + 2 * 768 * 12 * 64 + 12 * 64 * 768 + 2 * 768 * 3072)  # q, k, v, o; up and down
    assert plan["compute"]["flops"] == pytest.approx(6 * 1000 * (p * 500 + 4 * 12 * 64 * 500**2))
    pythia = tmp_path / "pythia.json"
    pythia.write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 2048, "num_hidden_layers": 24,
                                  "num_attention_heads": 16, "intermediate_size": 8192, "vocab_size": 50304,
                                  "rotary_pct": 0.25, "use_parallel_residual": True}))  # fmt: skip
    job_file.write_text(json.dumps({**job, "model": "EleutherAI/pythia-1.4b", "sites": {"resid_mid": [3]}}))
    result = run_tool("tools/plan.py", str(job_file), "--model-config", str(pythia), "--accelerator", "v6e-8",
                      "--rows", "1000", "--tokens-per-row", "500")  # fmt: skip
    assert result.returncode == 65 and "'resid_mid' is not a hook site of gpt_neox" in result.stderr, result.stderr


def test_shard_bytes_cuts_shards_as_the_writer_does():
    # 2 layers x 64 x 2 bytes + 4 = 260 bytes a token; shard_bytes 2600 is 10 tokens, so at 3 tokens a row a shard
    # holds 3 rows. Blocks of shard_size 8 rows are cut into 3 + 3 + 2: a task of 20 rows is 8 + 8 + 4 rows,
    # 3 + 3 + 2 shards.
    job = tiny_job(shard_size=8, shard_bytes=2600)
    tokens = costmodel.TokenEstimate.from_mean(rows=20, tokens_per_row=3, max_seq_len=32, source="test")
    assert costmodel.rows_per_shard(job, 3, 260) == 3
    assert costmodel.output_bytes(job, [64, 64], tokens, [20], 0).shards == 8
    # What the writer's own cut does with the same figures: ShardBounds over 20 rows of 3 tokens.
    from extract.batching import ShardBounds, shard_token_limit

    bounds = ShardBounds(0, 8, shard_token_limit(2600, 260))
    assert sum(bounds.starts_shard(position, 3) for position in range(20)) == 8


def test_fineweb_edu_sized_job_with_large_shard_size_is_cut_by_shard_bytes(tmp_path):
    """shard_size 4096 rows of 1040 tokens would be ~122 GB; the writer cuts at shard_bytes (256 MiB) first."""
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({**QWEN25_7B_JOB, "shard_size": 4096}))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--rows", "9672101",
                      "--tokens-per-row", "1040", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    out, tasks = plan["output"], plan["tasks"]
    # 256 MiB // 28676 bytes a token = 9360 tokens: 9 rows of 1040 tokens a shard.
    assert 2**28 // 28676 == 9360 and out["shard_rows"] == 9 and out["shard_cut_by"] == "shard_bytes"
    assert out["shard_bytes"] == pytest.approx(9 * (1040 * 28676 + 16), rel=1e-3)
    # Tasks of R rows are blocks of 4096 rows (455 shards of 9 and one of 1 each), then a shorter block.
    rows_per_task = tasks["recommended_rows_per_task"]
    task_rows = [rows_per_task] * (9672101 // rows_per_task) + [9672101 % rows_per_task]
    by_hand = sum(r // 4096 * 456 + math.ceil(r % 4096 / 9) for r in task_rows)
    assert out["shards"] == by_hand
    # A 268 MB shard is a resumable upload: one request to start it and three of 100 MiB.
    assert plan["operations"]["class_a"]["shard_uploads"] == by_hand * 4
    assert not any(w.startswith("shards of") for w in plan["warnings"])


def test_shards_above_a_large_shard_bytes_warn_and_name_shard_bytes(tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({**QWEN25_7B_JOB, "shard_size": 4096, "shard_bytes": 8 * 2**30}))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--rows", "9672101",
                      "--tokens-per-row", "1040", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    [warning] = [w for w in json.loads(result.stdout)["warnings"] if w.startswith("shards of")]
    assert "shards of ~8.59 GB" in warning and "shard_bytes 1073741824 gives about 1 GiB" in warning


def test_large_output_warns_loudly_with_what_would_shrink_it(tmp_path):
    result = plan_fineweb(tmp_path)
    assert result.returncode == 0, result.stderr
    warning = result.stdout[result.stdout.index("!!! WARNING: OUTPUT TOO LARGE") :]
    for remedy in ("fewer layers", "fewer rows", "token subsample", "fp16 is the same size as bf16"):
        assert remedy in warning


def test_dtype_advice_offers_fp8_and_is_right_for_every_stored_dtype(tmp_path):
    """The defect: the advice never offered fp8, and told an fp8 job that only fp32 changes its size.
    Each dtype's figure is the output the planner gives a job stored in that dtype, to 0.1 TB (the
    header bytes of a different shard count aside). In-process: four plans, one import of the planner."""
    import contextlib
    import io

    from tools import plan as plan_tool

    sizes, advice = {}, {}
    for dtype in ("fp32", "bf16", "fp16", "fp8"):
        job_file = tmp_path / f"job-{dtype}.json"
        job_file.write_text(json.dumps({**QWEN25_7B_JOB, "dtype": dtype}))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert plan_tool.main([str(job_file), "--accelerator", "v6e-8", "--rows", "9672101", "--tokens-per-row",
                                   "1040", "--json"]) == 0  # fmt: skip
        plan = json.loads(out.getvalue())
        sizes[dtype] = plan["output"]["bytes"] / 1e12
        [warning] = [w for w in plan["warnings"] if "OUTPUT TOO LARGE" in w]
        [advice[dtype]] = [line for line in warning.splitlines() if line.startswith("  - dtype")]

    # The v6e prices are a reading the last refresh of the table kept: the plan says so (reporting/prices.json, figures).
    assert any(w.startswith("tpu.v6e prices are those read around") for w in plan["warnings"])

    def figures(line: str) -> list[float]:
        return [float(x.replace(",", "")) for x in re.findall(r"about ([\d,.]+) TB", line)]

    assert sizes["fp8"] < 0.55 * sizes["bf16"] and sizes["bf16"] == sizes["fp16"]
    assert advice["fp8"].startswith("  - dtype: fp8 is already the smallest stored dtype") and "only fp32" not in advice["fp8"]
    assert figures(advice["fp8"]) == pytest.approx([sizes["bf16"]], abs=0.1)
    assert advice["fp32"].startswith("  - dtype fp8: about") and "bf16 or fp16: about" in advice["fp32"]
    assert figures(advice["fp32"]) == pytest.approx([sizes["fp8"], sizes["bf16"]], abs=0.1)
    for dtype in ("bf16", "fp16"):
        assert advice[dtype].startswith("  - dtype fp8: about") and "fp16 is the same size as bf16" in advice[dtype]
        assert figures(advice[dtype]) == pytest.approx([sizes["fp8"]], abs=0.1)


def test_output_under_the_threshold_does_not_warn(tmp_path):
    result = plan_fineweb(tmp_path, "--warn-output-tb", "1000", "--json")
    assert result.returncode == 0, result.stderr
    assert not any("OUTPUT TOO LARGE" in w for w in json.loads(result.stdout)["warnings"])


def test_unknown_accelerator_is_bad_input_naming_it(tmp_path):
    result = plan_fineweb(tmp_path, "--accelerator", "v9-8")
    assert result.returncode == 65
    assert "accelerator: 'v9-8'" in result.stderr and "v5litepod-8" in result.stderr


def test_bad_job_is_bad_input_naming_the_field(tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({k: v for k, v in QWEN25_7B_JOB.items() if k != "layers"}))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--rows", "10",
                      "--tokens-per-row", "5")  # fmt: skip
    assert result.returncode == 65
    assert "layers/sites: neither given" in result.stderr


def test_hub_model_without_a_config_is_bad_input_naming_model(tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({**QWEN25_7B_JOB, "model": "someone/unknown-model"}))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--rows", "10",
                      "--tokens-per-row", "5")  # fmt: skip
    assert result.returncode == 65
    assert "model: 'someone/unknown-model'" in result.stderr and "--model-config" in result.stderr


def test_make_tasks_auto_cuts_tasks_at_the_planners_recommendation(make_run_job, make_run_lengths, tmp_path):
    work, job, job_file, _ = make_run_job
    # The recommendation worked out here: v5litepod-1 is one v5e chip; MFU 0.35; a target of 1e-7 minutes.
    config = ModelConfig.from_file(pathlib.Path(job["model"]) / "config.json")
    tokens = costmodel.TokenEstimate.from_lengths(320, make_run_lengths, "test")
    chip = pricing.load_prices().accelerator("v5litepod-1").peak_flops
    recommended = costmodel.recommend_rows_per_task(config, 4, tokens, chip * 0.35, 1e-7 * 60, job["shard_size"])
    assert 1 < recommended < 320  # a real cut, so the check below means something

    tasks_file = tmp_path / "tasks.jsonl"
    made = run_tool("tools/make_tasks.py", str(job_file), "--rows-per-task", "auto", "--accelerator", "v5litepod-1",
                    "--target-minutes", "1e-7", "--fixed-seconds", "0", "--sample-rows", "1000", "-o",
                    str(tasks_file))  # fmt: skip
    assert made.returncode == 0, made.stderr
    lines = tasks_file.read_text().splitlines()
    sizes = [sum(f["end"] - f["start"] for f in json.loads(line)["files"]) for line in lines]
    assert sum(sizes) == 320
    assert all(size == recommended for size in sizes[:-1]) and 0 < sizes[-1] <= recommended


def test_make_tasks_auto_without_an_accelerator_names_the_flag(make_run_job, tmp_path):
    work, job, job_file, _ = make_run_job
    made = run_tool("tools/make_tasks.py", str(job_file), "--rows-per-task", "auto", "-o", str(tmp_path / "t.jsonl"))
    assert made.returncode == 65 and "--accelerator: missing" in made.stderr


def test_gs_model_is_planned_from_its_config_and_tokenizer_without_the_weights(gcs_client, gcs_bucket, tmp_path):
    import objectstore

    model = write_tiny_qwen(tmp_path / "model", model_type="qwen3", hidden=64, layers=3, heads=4, kv_heads=2)
    url = f"gs://{gcs_bucket}/models/tiny"
    store = objectstore.open_store(url)
    for path in model.iterdir():
        store.put(path.name, path.read_bytes())
    job = tiny_job(model=url)
    config, source, directory = costmodel.model_config(job, workdir=tmp_path / "fetched")
    assert config == ModelConfig.from_file(model / "config.json") and source == f"{url}/config.json"
    fetched = {p.name for p in directory.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= fetched
    assert not any(name.endswith(".safetensors") for name in fetched)


def test_price_table_peaks_agree_with_the_engines_mfu_table():
    """The planner and the consumer's MFU must divide by the same peak, or a measured MFU would not carry over."""
    import re

    from extract import engine

    device_kinds = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite",
                    "NVIDIA H100 80GB": "NVIDIA H100 80GB HBM3", "NVIDIA A100 40GB": "NVIDIA A100-SXM4-40GB",
                    "NVIDIA A100 80GB": "NVIDIA A100-SXM4-80GB", "NVIDIA L4": "NVIDIA L4",
                    "NVIDIA H200 141GB": "NVIDIA H200", "NVIDIA B200": "NVIDIA B200", "NVIDIA T4": "Tesla T4"}  # fmt: skip
    table = pricing.load_prices()
    for name in table.known_accelerators():
        machine = table.accelerator(name)
        kind = device_kinds[machine.family]
        engine_peak = next(flops for pattern, flops in engine._PEAK_BF16_FLOPS if re.search(pattern, kind))
        assert machine.peak_flops == pytest.approx(machine.chips * engine_peak), name


def test_rows_from_both_tasks_and_flags_is_bad_input(make_run_job):
    work, job, job_file, tasks_file = make_run_job
    result = run_tool("tools/plan.py", str(job_file), "--tasks", str(tasks_file), "--rows", "5",
                      "--accelerator", "v6e-8")  # fmt: skip
    assert result.returncode == 65 and "--rows/--stats" in result.stderr


def test_stats_file_plans_like_the_flags(tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"rows": 9672101, "tokens_per_row": 1040, "source": "issue 11"}))
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(QWEN25_7B_JOB))
    from_file = run_tool("tools/plan.py", str(job_file), "--accelerator", "v6e-8", "--stats", str(stats), "--json")
    from_flags = plan_fineweb(tmp_path, "--json")
    assert from_file.returncode == 0 == from_flags.returncode, from_file.stderr
    a, b = json.loads(from_file.stdout), json.loads(from_flags.stdout)
    assert a["output"] == b["output"] and a["compute"] == b["compute"] and a["tasks"] == b["tasks"]
    assert "issue 11" in a["tokens"]["source"]


def test_an_old_price_table_is_flagged(tmp_path):
    raw = json.loads(pricing.PRICES_FILE.read_text())
    raw["as_of"] = "2020-01-01"
    prices = tmp_path / "old.json"
    prices.write_text(json.dumps(raw))
    result = plan_fineweb(tmp_path, "--prices", str(prices), "--json")
    assert result.returncode == 0, result.stderr
    assert any("price table is" in w and "2020-01-01" in w for w in json.loads(result.stdout)["warnings"])


@pytest.mark.parametrize(
    "module, forbidden",
    [("extract/costmodel.py", {"fleet", "taskqueue", "jax", "flax"}), ("reporting/pricing.py", {"extract", "taskqueue"})],
)
def test_cost_modules_keep_to_their_floor(module, forbidden):
    """The extraction figures never import the cloud glue (or JAX), the prices never import the extraction."""
    import ast

    tree = ast.parse((REPO / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & forbidden, imported & forbidden
