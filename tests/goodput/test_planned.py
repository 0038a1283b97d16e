"""Planned: the planner counts a task's fixed seconds and sizes tasks so they stay within 2% of machine time; a
packed job compiles one program by default."""

from __future__ import annotations

import json

import numpy as np
import pytest

from extract import costmodel
from extract.batching import PACKED_WINDOW_BATCHES, TokenizedSample, pack_window
from extract.config import ModelConfig
from extract.job import Job, default_buckets
from reporting import plan as planner

QWEN7B = ModelConfig.from_dict(costmodel.KNOWN_CONFIGS["Qwen/Qwen2.5-7B"])
JOB = {"data_files": ["x.parquet"], "model": "Qwen/Qwen2.5-7B", "layers": [15, 16, 17, 18], "max_seq_len": 2048,
       "batch_size": 56, "shard_size": 64}  # fmt: skip


@pytest.mark.parametrize("shard_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("fixed_seconds", [0.0, 3.0, 50.0, 400.0])
def test_the_recommended_task_keeps_its_fixed_seconds_within_2pc_by_whole_shards(shard_size, fixed_seconds):
    tokens = costmodel.TokenEstimate.from_mean(rows=10**7, tokens_per_row=1000, max_seq_len=2048, source="test")
    rate = 100e12
    per_row = costmodel.seconds_per_row(QWEN7B, 18, tokens, rate)
    rows = costmodel.recommend_rows_per_task(QWEN7B, 18, tokens, rate, 60.0, shard_size, fixed_seconds=fixed_seconds)
    steady = rows * per_row
    assert fixed_seconds / (fixed_seconds + steady) <= costmodel.FIXED_SHARE + 1e-12
    assert steady >= 60.0 - per_row * shard_size  # the target still holds when the fixed seconds are small
    if costmodel.min_task_seconds(fixed_seconds) > 60.0 + per_row * shard_size:  # the floor decides: no more than a shard over it
        assert (rows - shard_size) * per_row < costmodel.min_task_seconds(fixed_seconds)
        assert rows % shard_size == 0 or rows < shard_size


def plan_of(tmp_path, job: dict, *flags: str) -> dict:
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    args = planner.parse_args([str(job_file), "--accelerator", "v6e-8", "--rows", "9672101", "--tokens-per-row", "1040",
                               *flags])  # fmt: skip
    return planner.make_plan(args)


def test_the_plan_counts_assumed_fixed_seconds_and_a_packed_job_needs_fewer(tmp_path):
    unpacked, packed = plan_of(tmp_path, JOB), plan_of(tmp_path, {**JOB, "packing": True})
    for plan, programs in ((unpacked, 6), (packed, 1)):
        fixed, tasks = plan["tasks"]["fixed"], plan["tasks"]
        assert fixed["platform"] == "tpu" and fixed["assumed"] and fixed["programs"] == programs
        assert fixed["warm_s"] == pytest.approx(sum(fixed["parts"][k] for k in ("base_s", "weights_s", "programs_s")))
        assert fixed["share_of_task"] <= costmodel.FIXED_SHARE + 1e-9  # the last, shorter task may take a bit more
        assert fixed["share_of_job"] == pytest.approx(
            tasks["count"] * fixed["warm_s"] / (tasks["count"] * fixed["warm_s"] + plan["time"]["machine_hours"] * 3600))
        assert tasks["recommended_task_minutes"] >= fixed["min_task_minutes"] > tasks["target_minutes"]
        # The fixed machine-hours: every task's warm start, and the first-task extra of each machine that gets one
        # (32 machines, the default).
        hours = (tasks["count"] * fixed["warm_s"] + min(32, tasks["count"]) * fixed["first_task_extra_s"]) / 3600
        assert fixed["machine_hours"] == pytest.approx(hours)
        assert plan["total_dollars"]["spot"] == pytest.approx(
            plan["compute_dollars"]["spot"] + fixed["spot"] + plan["storage"]["dollars"] + plan["operations"]["dollars"])
        text = planner.render(plan)
        assert "ASSUMED: no TPU has measured a task's phases yet" in text and "keeps the fixed seconds under 2%" in text
    assert packed["tasks"]["fixed"]["warm_s"] < unpacked["tasks"]["fixed"]["warm_s"]


def test_a_measured_fixed_seconds_replaces_the_assumption(tmp_path):
    plan = plan_of(tmp_path, JOB, "--fixed-seconds", "12")
    fixed = plan["tasks"]["fixed"]
    assert (fixed["warm_s"], fixed["assumed"], fixed["source"]) == (12.0, False, "given (--fixed-seconds)")
    assert fixed["min_task_minutes"] == pytest.approx(12 * 49 / 60)
    with pytest.raises(Exception, match="--fixed-seconds: got -1.0"):
        plan_of(tmp_path, JOB, "--fixed-seconds", "-1")


def test_a_packed_job_defaults_to_one_bucket_and_pays_almost_no_padding_for_it():
    job = Job.from_dict({**JOB, "packing": True})
    assert job.buckets == (2048,) == default_buckets(2048, packing=True)
    assert Job.from_dict(JOB).buckets == (64, 128, 256, 512, 1024, 2048)
    assert Job.from_dict({**JOB, "packing": True, "buckets": [1024, 2048]}).buckets == (1024, 2048)  # as given
    # Packed windows of FineWeb-Edu-like lengths: the smaller buckets would save under a point of padding.
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(700), 0.9, 20 * PACKED_WINDOW_BATCHES * 8).astype(int), 1, 2048)
    real = padded = single = 0
    for w in range(0, len(lengths), PACKED_WINDOW_BATCHES * 8):
        window = [TokenizedSample(i, i, np.zeros(n, np.int32)) for i, n in enumerate(lengths[w : w + PACKED_WINDOW_BATCHES * 8])]
        for batch in pack_window(window, 8, default_buckets(2048), 0):
            real, padded, single = real + batch.n_tokens, padded + batch.token_ids.size, single + 8 * 2048
    assert 0 <= (1 - real / single) - (1 - real / padded) < 0.01


def test_the_plan_takes_its_fixed_seconds_from_the_queues_ledgers_where_they_exist(tmp_path):
    """Done markers whose consumers reported their phases give the fixed seconds of an attempt (reporting.goodput:
    48 s over 3 attempts = 16 s), labelled as measured, in place of the platform's assumed figure; a queue whose
    markers report none leaves the assumed figure, labelled ASSUMED."""
    from extract.phases import ATTEMPTS, counter_name
    from objectstore import open_store
    from reporting.plan import render
    from taskqueue import layout
    from tests.goodput.test_goodput_status import T01, T02

    queue = tmp_path / "queue"
    queue.mkdir()
    empty = plan_of(tmp_path, JOB, "--queue", str(queue))
    assert empty["tasks"]["fixed"]["assumed"] and "ASSUMED" in render(empty)

    store = open_store(str(queue))
    for task, phases, attempts in (("t01", T01, 2), ("t02", T02, 1)):
        counters = json.dumps({**{counter_name(p): ms for p, ms in phases.items()}, ATTEMPTS: attempts})
        store.create(layout.done_object(task), b"{}", metadata={"completed_at": "2026-11-28T09:00:00+00:00",
                                                                 "seconds": "100.0", "counters": counters})  # fmt: skip
    measured = plan_of(tmp_path, JOB, "--queue", str(queue))
    fixed = measured["tasks"]["fixed"]
    assert fixed["warm_s"] == 16.0 and fixed["first_task_extra_s"] == 0.0 and not fixed["assumed"]
    assert fixed["source"].startswith("measured: the ledgers of 3 attempts") and str(queue) in fixed["source"]
    assert "ASSUMED" not in render(measured) and "16.00 s a task" in render(measured)
    count = measured["tasks"]["count"]
    assert fixed["machine_hours"] == pytest.approx(count * 16.0 / 3600)
