"""The job/task/resume schema: one place that accepts good input and names the field of bad input."""

from __future__ import annotations

import pytest

from extract.errors import BadInput
from extract.job import Job, ResumeState, Task, default_buckets, load_job, plan_tasks

GOOD_JOB = {"data_files": ["/data/*.parquet"], "model": "Qwen/Qwen3-0.6B", "layers": [6, -1], "max_seq_len": 512,
            "batch_size": 8, "shard_size": 256}  # fmt: skip


def test_job_defaults_fill_optional_fields():
    job = Job.from_dict(GOOD_JOB)
    assert (job.text_field, job.dtype, job.compute_dtype, job.mesh) == ("text", "bf16", "bf16", None)
    assert job.buckets == (64, 128, 256, 512)
    assert job.out_dtype_name == "bfloat16" and job.layers == (6, -1)
    assert Job.from_dict(job.to_dict()) == job


def test_default_buckets_are_powers_of_two_ending_at_max_seq_len():
    assert default_buckets(2048) == (64, 128, 256, 512, 1024, 2048)
    assert default_buckets(300) == (64, 128, 256, 300)
    assert default_buckets(40) == (40,)


def test_hub_dataset_form_is_accepted():
    raw = {k: v for k, v in GOOD_JOB.items() if k != "data_files"}
    job = Job.from_dict({**raw, "dataset": {"name": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT"}})
    assert job.dataset is not None and job.dataset.split == "train" and job.data_files == ()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer": [3]}, "layer"),  # a typo is an unknown field, not a silent default
        ({"dtype": "int8"}, "dtype"),
        ({"compute_dtype": "fp16"}, "compute_dtype"),
        ({"layers": []}, "layers"),
        ({"layers": [1, 1]}, "layers"),
        ({"layers": ["1"]}, "layers"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"shard_size": True}, "shard_size"),
        ({"mesh": "data=2,tensor=2"}, "mesh"),
        ({"buckets": [64, 32, 512]}, "buckets"),
        ({"buckets": [64, 256]}, "buckets"),  # must end at max_seq_len
        ({"text_field": ""}, "text_field"),
        ({"model": None}, "model"),
        ({"data_files": []}, "data_files"),
        ({"dataset": {"name": "x"}}, "dataset/data_files"),  # both sources given
        ({"data_files": None, "dataset": {"nme": "x"}}, "dataset.nme"),
    ],
)
def test_bad_job_field_is_named(change, field):
    raw = {**GOOD_JOB, **change}
    raw = {k: v for k, v in raw.items() if not (k == "data_files" and v is None)}
    with pytest.raises(BadInput) as error:
        Job.from_dict(raw)
    assert str(error.value).startswith(field), str(error.value)


def test_missing_required_job_field_is_named():
    raw = dict(GOOD_JOB)
    del raw["shard_size"]
    with pytest.raises(BadInput, match="^shard_size: missing"):
        Job.from_dict(raw)


TASK = {"id": "t000001", "files": [{"path": "a.parquet", "base": 0, "start": 5, "end": 10},
                                   {"path": "b.parquet", "base": 10, "start": 0, "end": 3}]}  # fmt: skip


def test_task_counts_positions_across_files():
    task = Task.from_dict(TASK)
    assert task.num_samples == 8
    assert Task.from_dict(task.to_dict()) == task


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"id": ""}, "task.id"),
        ({"files": []}, "task.files"),
        ({"files": [{"path": "a.parquet", "start": 3, "end": 3}]}, "task.files"),  # an empty slice
        ({"files": [{"path": "a.parquet", "start": 4, "end": 3}]}, "task.files[0].end"),
        ({"files": [{"path": "a.parquet", "start": -1, "end": 3}]}, "task.files[0].start"),
        ({"files": [{"path": "a.parquet", "start": 0, "end": 3, "rows": 3}]}, "task.files[0].rows"),
        ({"shard": 1}, "task.shard"),
    ],
)
def test_bad_task_field_is_named(change, field):
    with pytest.raises(BadInput) as error:
        Task.from_dict({**TASK, **change})
    assert str(error.value).startswith(field), str(error.value)


def record(start: int, end: int) -> dict:
    return {"shard": f"/o/shard-{start}-{end}", "sample_start": start, "sample_end": end}


def test_resume_continues_after_the_committed_prefix():
    task = Task.from_dict(TASK)
    resume = ResumeState.from_dict({"task": "t000001", "attempt": 3, "progress": [record(4, 6), record(0, 4)]}, task)
    assert resume.committed == 6 and resume.attempt == 3
    assert ResumeState.from_dict({"task": "t000001", "attempt": 1, "progress": []}, task).committed == 0


@pytest.mark.parametrize(
    "progress",
    [[record(0, 4), record(5, 6)], [record(0, 4), record(2, 6)], [record(0, 9)]],
    ids=["gap", "overlap", "past-the-end"],
)
def test_resume_records_that_do_not_tile_the_slice_are_rejected(progress):
    with pytest.raises(BadInput, match="resume"):
        ResumeState.from_dict({"task": "t000001", "attempt": 2, "progress": progress}, Task.from_dict(TASK))


def test_resume_file_of_another_task_is_rejected():
    with pytest.raises(BadInput, match="resume.task"):
        ResumeState.from_dict({"task": "t000002", "attempt": 2, "progress": []}, Task.from_dict(TASK))


def test_plan_tasks_spans_file_boundaries_with_cumulative_bases():
    tasks = plan_tasks([("a", 7), ("empty", 0), ("b", 5), ("c", 9)], rows_per_task=6)
    assert [t.num_samples for t in tasks] == [6, 6, 6, 3]
    assert [t.id for t in tasks] == ["t000000", "t000001", "t000002", "t000003"]
    ids = [f.base + r for t in tasks for f in t.files for r in range(f.start, f.end)]
    assert ids == list(range(21))  # disjoint and covering, in order
    assert [(f.path, f.base, f.start, f.end) for f in tasks[1].files] == [("a", 0, 6, 7), ("b", 7, 0, 5)]
    assert all(f.path != "empty" for t in tasks for f in t.files)


# ---- one test per rule the hand-written validator checked and the tests above did not ----

HUB = {k: v for k, v in GOOD_JOB.items() if k != "data_files"} | {"dataset": {"name": "HuggingFaceFW/fineweb-edu"}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (["not", "an", "object"], "^job: must be a mapping of field names to values"),
        (HUB | {"dataset": None}, "^dataset/data_files: neither given; give exactly one"),
        ({**HUB, "dataset": "HuggingFaceFW/fineweb-edu"}, "^dataset: must be a mapping"),
        ({**HUB, "dataset": {"config": "x"}}, "^dataset.name: missing; a required field: the Hub dataset id"),
        ({**HUB, "dataset": {"name": "x", "config": ""}}, "^dataset.config: must be a non-empty string, got ''"),
        ({**HUB, "dataset": {"name": "x", "split": None}}, "^dataset.split: must be a non-empty string, got None"),
        ({**GOOD_JOB, "data_files": ["a.parquet", " "]}, r"^data_files\[1\]: must be a non-empty string, got ' '"),
        ({**GOOD_JOB, "data_files": 3}, "^data_files: must be a path, glob or URL, or a non-empty list of them, got 3"),
        ({**GOOD_JOB, "layers": [True]}, r"^layers\[0\]: must be a layer index \(an integer\), got True"),
        ({**GOOD_JOB, "mesh": 4}, "^mesh: must be axis=size pairs over data/model"),
        ({**GOOD_JOB, "mesh": "data=2,data=2"}, "^mesh: must be axis=size pairs over data/model"),
        ({**GOOD_JOB, "mesh": "data=0"}, "^mesh: must be axis=size pairs over data/model"),
        ({**GOOD_JOB, "buckets": []}, "^buckets: must be a strictly increasing list of positive lengths, got \\[\\]"),
        ({**GOOD_JOB, "buckets": [0, 512]}, r"^buckets\[0\]: must be a positive integer, got 0"),
        ({**GOOD_JOB, "shard_bytes": 0}, "^shard_bytes: must be a positive integer, got 0"),
        ({**GOOD_JOB, "packing": "yes"}, "^packing: must be true or false, got 'yes'"),
        ({**GOOD_JOB, "lr": 1, "layer": 2}, "^layer: unknown field; .*use one of: .*layers.* \\(also wrong: lr\\)$"),
        ({**GOOD_JOB, "dtype": "fp8", "sites": {"expert_indices": [0]}},
         "^dtype/sites.expert_indices: fp8 cannot store expert indices exactly; use dtype bf16, fp16 or fp32"),
    ],
)
def test_job_rule_violation_names_the_field_and_what_to_write(raw, message):
    with pytest.raises(BadInput, match=message):
        Job.from_dict(raw)


def test_job_optional_fields_default_and_a_single_data_file_becomes_a_list():
    job = Job.from_dict({**GOOD_JOB, "data_files": "/data/one.parquet", "buckets": None})
    assert job.data_files == ("/data/one.parquet",)
    assert job.buckets == default_buckets(512)  # null means the default, as an absent field does
    assert (job.shard_bytes, job.packing, job.on_bad_row) == (256 * 1024 * 1024, False, "skip")


def test_hub_job_round_trips_without_data_files_or_nulls():
    job = Job.from_dict({**HUB, "mesh": "data=2,model=1"})
    assert job.to_dict()["dataset"] == {"name": "HuggingFaceFW/fineweb-edu", "split": "train"}
    assert "data_files" not in job.to_dict()
    assert Job.from_dict(job.to_dict()) == job


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("t000001", "^task: must be a mapping"),
        ({"files": TASK["files"]}, "^task.id: missing"),
        ({**TASK, "files": "a.parquet"}, "^task.files: must list slices"),
        ({**TASK, "files": ["a.parquet"]}, r"^task.files\[0\]: must be a mapping"),
        ({**TASK, "files": [{"path": "a.parquet", "start": 0}]}, r"^task.files\[0\].end: missing"),
        ({**TASK, "files": [{"path": "", "start": 0, "end": 3}]}, r"^task.files\[0\].path: must be a non-empty string"),
        ({**TASK, "files": [{"path": "a", "base": -1, "start": 0, "end": 3}]}, r"^task.files\[0\].base: must be a non"),
    ],
)
def test_task_rule_violation_names_the_field(raw, message):
    with pytest.raises(BadInput, match=message):
        Task.from_dict(raw)


def test_file_base_defaults_to_zero():
    task = Task.from_dict({"id": "t", "files": [{"path": "a.parquet", "start": 2, "end": 4}]})
    assert task.files[0].base == 0 and task.num_samples == 2


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "^resume: must be a mapping"),
        ({"progress": {"sample_start": 0}}, "^resume.progress: must be a list of progress records"),
        ({"attempt": 0}, "^resume.attempt: must be a 1-based attempt number, got 0"),
        ({"attempt": "2"}, "^resume.attempt: must be a 1-based attempt number, got '2'"),
        ({"progress": ["shard-0"]}, r"^resume.progress\[0\]: must be a mapping"),
        ({"progress": [{"sample_start": 0}]}, r"^resume.progress\[0\].sample_end: missing"),
        ({"progress": [{"sample_start": -1, "sample_end": 2}]}, r"^resume.progress\[0\].sample_start: must"),
        ({"progress": [record(3, 3)]}, r"^resume.progress\[0\]: covers \[3, 3\), outside the task's 8 samples"),
    ],
)
def test_resume_rule_violation_names_the_field(raw, message):
    with pytest.raises(BadInput, match=message):
        ResumeState.from_dict(raw, Task.from_dict(TASK))


def test_resume_defaults_to_attempt_one_and_keeps_each_records_other_fields():
    raw = {"progress": [{**record(0, 2), "skipped": [1]}], "worker": "w1"}
    resume = ResumeState.from_dict(raw, Task.from_dict(TASK))
    assert resume.attempt == 1 and resume.committed == 2
    assert resume.records == ({**record(0, 2), "skipped": [1]},) and resume.listed_skipped == 1


def test_unreadable_or_non_json_job_file_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="^job file: cannot read"):
        load_job(tmp_path / "missing.json")
    (tmp_path / "job.json").write_text("{not json")
    with pytest.raises(BadInput, match="^job file: .* is not JSON"):
        load_job(tmp_path / "job.json")


def test_plan_tasks_rejects_a_non_positive_task_size():
    with pytest.raises(BadInput, match="^rows_per_task: got 0"):
        plan_tasks([("a", 5)], rows_per_task=0)
