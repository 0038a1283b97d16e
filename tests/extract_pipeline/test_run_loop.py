"""The run loop in-process: fixed shapes keep XLA to one program per bucket; progress is a bar on a terminal and
key=value lines in a log."""

from __future__ import annotations

import logging

from extract.batching import Tokenizer, batches_for_slice
from extract.consumer import ProgressDisplay, RunInputs, run
from extract.data import read_slice
from extract.job import Job, Task
from tests.extract_pipeline.conftest import base_job


def test_200_mixed_length_samples_compile_one_program_per_bucket_used(tmp_path, tiny_models, corpus):
    job = Job.from_dict(base_job(tiny_models["qwen3"], corpus, buckets=[16, 32, 64, 128], shard_size=50))
    task = Task.from_dict({"id": "t000200", "files": corpus.slice_files([(0, 0, 90), (1, 0, 50), (2, 0, 60)])})
    assert task.num_samples == 200

    result = run(RunInputs(job=job, task=task, output_url=str(tmp_path / "out")))

    planned = list(
        batches_for_slice(read_slice(task, job.text_field), Tokenizer(tiny_models["qwen3"], job.max_seq_len), start=0,
                          end=200, batch_size=result.engine.batch_size, shard_size=job.shard_size, buckets=job.buckets)
    )  # fmt: skip
    used = {b.bucket for b in planned if b.token_ids is not None}
    assert len(planned) >= 40 and len(used) >= 3, "the slice must exercise many batches over several buckets"
    assert result.engine.compiled_programs == len(used) <= len(job.buckets)
    assert [r["sample_end"] for r in result.records] == [50, 100, 150, 200]
    assert result.stats["samples"] == 200 and result.stats["tokens_per_s"] > 0


def test_progress_without_a_tty_is_a_key_value_log_line(caplog):
    display = ProgressDisplay(total=10, every_s=0.0, tty=False)
    with caplog.at_level(logging.INFO, logger="extract.consumer"):
        display.update(4, 120)
    display.close()
    (line,) = [r.getMessage() for r in caplog.records if "event=progress" in r.getMessage()]
    assert "samples=4 total=10 tokens=120" in line


def test_progress_on_a_terminal_is_a_bar_with_the_token_rate_and_no_log_line(capsys, caplog):
    display = ProgressDisplay(total=10, every_s=0.0, tty=True)
    with caplog.at_level(logging.INFO, logger="extract.consumer"):
        display.update(4, 120)
        display.update(6, 180)
        display.close()
    bar = capsys.readouterr().err
    assert "10/10" in bar and "samples/s" in bar and "tokens_per_s=" in bar
    assert [r.getMessage() for r in caplog.records if "event=" in r.getMessage()] == []


def test_progress_in_a_log_leaves_the_closing_line_to_the_task(caplog):
    display = ProgressDisplay(total=10, every_s=60.0, tty=False)
    with caplog.at_level(logging.INFO, logger="extract.consumer"):
        display.update(10, 300)
        display.close()  # run() logs the task's end with its figures; the reporter adds none of its own
    assert [r.getMessage() for r in caplog.records if "event=" in r.getMessage()] == []
