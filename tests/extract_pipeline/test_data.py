"""Data files: row counts from parquet footers only, slices read from the row groups they touch, JSON Lines, plans."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from extract import data
from extract.errors import BadInput
from extract.job import Task
from extract.tiny import write_fineweb_like_parquet

from tests.extract_pipeline.conftest import REPO, write_json


def scramble_text_pages(path: pathlib.Path, row_groups: list[int]) -> None:
    """Overwrite the text column's pages in `row_groups` with garbage; the footer stays intact."""
    meta = pq.ParquetFile(path).metadata
    payload = bytearray(path.read_bytes())
    for group in row_groups:
        column = meta.row_group(group).column(0)
        begin = column.dictionary_page_offset or column.data_page_offset
        payload[begin : begin + column.total_compressed_size] = b"\xa5" * column.total_compressed_size
    path.write_bytes(bytes(payload))


def test_row_counts_come_from_the_footer_alone(tmp_path):
    (path,) = write_fineweb_like_parquet(tmp_path, 1, 50, seed=3)
    scramble_text_pages(path, list(range(pq.ParquetFile(path).metadata.num_row_groups)))
    assert data.count_rows(str(path)) == 50
    with pytest.raises(Exception):
        pq.read_table(path)  # the data really is unreadable; only the footer was needed


def test_slice_reads_only_the_row_groups_it_touches(tmp_path):
    (path,) = write_fineweb_like_parquet(tmp_path, 1, 64, seed=4, row_group_size=16)
    expected = pq.read_table(path).column("text").to_pylist()
    scramble_text_pages(path, [0, 3])
    task = Task.from_dict({"id": "t", "files": [{"path": str(path), "base": 1000, "start": 20, "end": 45}]})
    docs = list(data.read_slice(task, "text"))
    assert [d.text for d in docs] == expected[20:45]
    assert [d.sample_id for d in docs] == list(range(1020, 1045)) and [d.position for d in docs] == list(range(25))
    assert [d.position for d in data.read_slice(task, "text", skip=10)] == list(range(10, 25))


def test_jsonl_rows_are_non_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": ""}\n{"text": "c", "x": 1}\n')
    assert data.count_rows(str(path)) == 3
    task = Task.from_dict({"id": "t", "files": [{"path": str(path), "base": 0, "start": 1, "end": 3}]})
    assert [d.text for d in data.read_slice(task, "text")] == ["", "c"]
    array = tmp_path / "d.json"
    array.write_text(json.dumps([{"text": "x"}, {"text": "y"}]))
    assert data.count_rows(str(array)) == 2


def test_non_string_jsonl_text_is_a_bad_row_not_a_failed_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": 7}\n')
    task = Task.from_dict({"id": "t", "files": [{"path": str(path), "base": 0, "start": 0, "end": 2}]})
    good, bad = data.read_slice(task, "text")
    assert good.text == "a" and good.bad is None
    assert (bad.position, bad.row, bad.bad.reason) == (1, 1, "not_a_string") and "int" in bad.bad.detail


def test_task_asking_for_rows_past_the_file_end_is_bad_input(corpus):
    task = Task.from_dict({"id": "t", "files": corpus.slice_files([(1, 0, 51)])})
    with pytest.raises(BadInput, match="has 50 rows"):
        data.check_task_files(task, "text")


def test_globs_and_directories_expand_sorted(tmp_path, corpus):
    assert data.expand_data_files([str(corpus.files[0].parent)]) == [str(f) for f in corpus.files]
    pattern = str(corpus.files[0].parent / "00[12]_*.parquet")
    assert data.expand_data_files([pattern]) == [str(f) for f in corpus.files[1:]]
    with pytest.raises(BadInput, match="matches no file"):
        data.expand_data_files([str(tmp_path / "*.parquet")])


def plan(job: dict, tmp_path: pathlib.Path, rows_per_task: int) -> list[dict]:
    job_file = write_json(tmp_path / "job.json", job)
    out = tmp_path / "tasks.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_tasks.py"), str(job_file), "--rows-per-task", str(rows_per_task),
         "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def assert_disjoint_and_covering(tasks: list[dict], counts: list[int], rows_per_task: int) -> None:
    ids = [f["base"] + r for t in tasks for f in t["files"] for r in range(f["start"], f["end"])]
    assert ids == list(range(sum(counts)))  # every global sample id once, in order
    sizes = [sum(f["end"] - f["start"] for f in t["files"]) for t in tasks]
    assert all(s == rows_per_task for s in sizes[:-1]) and 0 < sizes[-1] <= rows_per_task
    assert len({t["id"] for t in tasks}) == len(tasks)


def test_make_tasks_plans_from_footers_across_file_boundaries(tmp_path):
    counts = [23, 41, 17]
    files = write_fineweb_like_parquet(tmp_path / "data", 3, counts, seed=5)
    for path in files:
        scramble_text_pages(path, list(range(pq.ParquetFile(path).metadata.num_row_groups)))
    job = {"data_files": [str(tmp_path / "data" / "*.parquet")], "model": "m", "layers": [1], "max_seq_len": 64,
           "batch_size": 2, "shard_size": 8}  # fmt: skip
    tasks = plan(job, tmp_path, rows_per_task=10)
    assert_disjoint_and_covering(tasks, counts, 10)
    assert len(tasks) == 9 and any(len(t["files"]) == 2 for t in tasks)
    assert {f["path"] for t in tasks for f in t["files"]} == {str(p) for p in files}
    Task.from_dict(tasks[0])  # the consumer accepts what the planner writes


def test_make_tasks_counts_jsonl_lines(tmp_path):
    (tmp_path / "data").mkdir()
    for name, n in (("a.jsonl", 7), ("b.jsonl", 5)):
        (tmp_path / "data" / name).write_text("".join(json.dumps({"text": f"row {i}"}) + "\n\n" for i in range(n)))
    job = {"data_files": str(tmp_path / "data"), "model": "m", "layers": [1], "max_seq_len": 64, "batch_size": 2,
           "shard_size": 8}  # fmt: skip
    assert_disjoint_and_covering(plan(job, tmp_path, rows_per_task=5), [7, 5], 5)
