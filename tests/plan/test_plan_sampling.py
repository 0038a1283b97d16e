"""The planner on sampled jobs (token_sample, drop_first): tokens stored, bytes, shards, dollars and operations,
and the sample rate that fits a storage budget; by hand, and against what the writer really stores."""

from __future__ import annotations

import json
import math

import pytest

from activations.sampling import TokenSampling
from extract import costmodel
from extract.errors import BadInput
from tests.plan.test_plan import QWEN25_7B_JOB, load_plan_tool, run_tool

ROWS, PER_ROW = 9672101, 1040
GIB = 2**30


def plan_seed_job(tmp_path, *extra: str, **job) -> dict:
    """The seed job of issue 31: Qwen2.5-7B, layers 15-18, FineWeb-Edu sample-10BT, 32 x v4-8, bf16."""
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({**QWEN25_7B_JOB, **job}))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v4-8", "--machines", "32", "--rows", str(ROWS),
                      "--tokens-per-row", str(PER_ROW), "--json", *extra)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_seed_job_sampled_at_a_tenth_stores_under_30_tb(tmp_path):
    before, after = plan_seed_job(tmp_path), plan_seed_job(tmp_path, token_sample=0.1)
    # By hand: a stored token costs 4 x 3584 x 2 bytes + a 4-byte token id + a 4-byte position; every row keeps its
    # 16 bytes of sample id and offset; shards of 64 rows (104 tokens a row: 64 x 104 x 28680 B < 256 MiB).
    assert after["output"]["bytes_per_token"] == 4 * 3584 * 2 + 4 + 4
    assert after["sampling"]["stored_tokens"] == pytest.approx(ROWS * 0.1 * PER_ROW)
    assert after["output"]["shard_rows"] == 64 and after["output"]["shard_cut_by"] == "shard_size"
    rows_per_task = after["tasks"]["recommended_rows_per_task"]
    task_rows = [rows_per_task] * (ROWS // rows_per_task) + [ROWS % rows_per_task]
    assert after["output"]["shards"] == sum(math.ceil(r / 64) for r in task_rows)
    tensors = ROWS * 0.1 * PER_ROW * 28680 + ROWS * 16
    assert after["output"]["activation_bytes"] + after["output"]["sample_bytes"] == pytest.approx(tensors)
    assert after["output"]["bytes"] <= 30e12 < before["output"]["bytes"] / 9
    assert after["storage"]["dollars_per_month"] == pytest.approx(after["output"]["bytes"] / GIB * 0.02)
    # Operations follow the shards: 64-row shards of ~191 MB, a resumable upload each (1 + 2 chunks of 100 MiB).
    assert after["operations"]["class_a"]["shard_uploads"] == after["output"]["shards"] * 3
    # The compute is the same: the forward pass runs on whole documents.
    assert after["compute"]["flops"] == before["compute"]["flops"]
    # Every document keeps some of its 1040 tokens: 1 - 0.9^1040 rounds to 1.
    assert after["sampling"]["documents_covered"] == pytest.approx(ROWS)


def test_storage_budget_suggests_the_largest_rate_that_fits_and_what_it_covers(tmp_path):
    plan = plan_seed_job(tmp_path, "--storage-budget-tb", "30")
    budget = plan["storage_budget"]
    assert budget["token_sample"] == 0.1 and budget["bytes"] <= 30e12
    # One step up (two significant digits) no longer fits.
    over = plan_seed_job(tmp_path, token_sample=0.11)
    assert over["output"]["bytes"] > 30e12
    assert budget["bytes"] == pytest.approx(plan_seed_job(tmp_path, token_sample=0.1)["output"]["bytes"])
    # Diversity: every document at a tenth of its tokens, against all tokens of about 30/288 of the documents.
    assert budget["documents_covered"] == pytest.approx(ROWS)
    assert budget["rows_if_unsampled"] == int(ROWS * 30e12 / plan["output"]["bytes"])
    text = load_plan_tool().render(plan)
    assert "budget      30 TB: token_sample 0.1 stores" in text and "every token of fewer rows would cover" in text


def test_a_budget_below_the_per_row_bytes_is_said_to_fit_no_rate(tmp_path):
    plan = plan_seed_job(tmp_path, "--storage-budget-tb", "0.0001")
    assert plan["storage_budget"]["token_sample"] is None
    assert "no token_sample fits" in load_plan_tool().render(plan)


def test_drop_first_and_short_documents_in_covered_documents():
    sampling = TokenSampling(0.5, drop_first=2)
    tokens = costmodel.TokenEstimate.from_lengths(rows=4, lengths=[0, 2, 3, 10], source="test")
    # Stored on average: 0 + 0 + 0.5 x 1 + 0.5 x 8 per row; covered: 0, 0, 1 - 0.5, 1 - 0.5^8.
    assert costmodel.stored_tokens_per_row(tokens, sampling) == pytest.approx((0.5 + 4) / 4)
    assert costmodel.documents_covered(tokens, sampling) == pytest.approx((0.5 + 1 - 0.5**8) / 4)


def test_bad_storage_budget_is_bad_input_naming_the_flag(tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(QWEN25_7B_JOB))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", "v4-8", "--rows", "10", "--tokens-per-row",
                      "10", "--storage-budget-tb", "0")  # fmt: skip
    assert result.returncode == 65 and "--storage-budget-tb" in result.stderr


def test_planned_sampled_output_agrees_with_what_the_writer_stores(tmp_path):
    """A tiny sampled job planned from its tokenised rows, then run: the writer's stored tokens are exactly what the
    sampling rule keeps, and the plan's expectation is within a few percent of them and of the bytes written."""
    from extract.consumer import RunInputs, run
    from extract.data import read_slice
    from extract.job import Job, plan_tasks
    from extract.tiny import write_fineweb_like_parquet, write_tiny_qwen

    model = write_tiny_qwen(tmp_path / "model", model_type="qwen2", hidden=64, layers=2, heads=4, kv_heads=2)
    [data] = write_fineweb_like_parquet(tmp_path / "data", n_files=1, rows_per_file=120, seed=5)
    spec = {"model": str(model), "data_files": [str(data)], "layers": [1, 2], "max_seq_len": 128, "batch_size": 4,
            "shard_size": 32, "token_sample": 0.3, "drop_first": 1}  # fmt: skip
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec))
    tasks = plan_tasks([(str(data), 120)], 60)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in tasks))
    result = run_tool("tools/plan.py", str(job_file), "--tasks", str(tmp_path / "tasks.jsonl"), "--accelerator",
                      "v4-8", "--sample-rows", "1000", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    job = Job.from_dict(spec)
    from extract.batching import Tokenizer

    tokenizer = Tokenizer(str(model), 128)
    rule = written = stored = shards = 0
    for task in tasks:
        docs = list(read_slice(task, "text"))
        for doc, ids in zip(docs, tokenizer.encode([d.text for d in docs])):
            rule += len(job.sampling.kept(doc.sample_id, len(ids)))
        records = run(RunInputs(job=job, task=task, output_url=str(tmp_path / "out" / task.id))).records
        written += sum(r["bytes"] for r in records)
        stored += sum(r["tokens"] for r in records)
        shards += len(records)
    assert stored == rule
    assert plan["output"]["shards"] == shards == 4
    assert plan["sampling"]["stored_tokens"] == pytest.approx(stored, rel=0.08)
    assert plan["output"]["bytes"] == pytest.approx(written, rel=0.08)


def test_seed_job_sampled_at_a_tenth_in_fp8_stores_under_15_tb(tmp_path):
    """A job asking for fp8, planned by tools/plan.py: a stored token is 4 layers x (3584 e4m3 bytes + a 4-byte
    scale), a token id and a position."""
    bf16, fp8 = plan_seed_job(tmp_path, token_sample=0.1), plan_seed_job(tmp_path, token_sample=0.1, dtype="fp8")
    assert fp8["output"]["bytes_per_token"] == 4 * (3584 + 4) + 4 + 4
    tensors = ROWS * 0.1 * PER_ROW * 14360 + ROWS * 16
    assert fp8["output"]["activation_bytes"] + fp8["output"]["sample_bytes"] == pytest.approx(tensors)
    assert fp8["output"]["bytes"] <= 15e12 < bf16["output"]["bytes"] <= 30e12
    assert fp8["output"]["bytes"] == pytest.approx(tensors, rel=1e-3)  # with the shards' headers
    assert fp8["storage"]["dollars_per_month"] == pytest.approx(fp8["output"]["bytes"] / GIB * 0.02)
    assert fp8["compute"]["flops"] == bf16["compute"]["flops"]


def test_an_unknown_dtype_is_bad_input_naming_the_choices():
    from extract.job import Job

    with pytest.raises(BadInput, match="dtype: must be one of bf16, fp16, fp32, fp8"):
        Job.from_dict({**QWEN25_7B_JOB, "dtype": "fp4"})
