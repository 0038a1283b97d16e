"""Bad rows are a per-row matter: each awkward row kind is skipped and recorded (or, with on_bad_row=fail,
dead-letters the task with exit 65), and the task's other rows are extracted as usual."""

from __future__ import annotations

import io
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import objectstore
from extract import data
from extract.batching import Tokenizer, batches_for_slice
from extract.errors import BadInput
from extract.job import Job, ResumeState, Task
from activations.reader import open_activations
from extract.writer import MAX_LISTED_SKIPPED, ProgressLog, ShardWriter
from tests.extract_pipeline.conftest import ConsumeRun, base_job

GOOD = "good"
#: The parquet file: (value, why it is bad or None). Values are bytes so that invalid UTF-8 can be written.
PARQUET_ROWS = [
    (b"The first good row.", None),
    (None, "null"),
    (b"caf\xe9 in latin-1", "invalid_utf8"),
    (b"A third good row, with a few more words in it.", None),
    (b"", None),  # empty text: a zero-token sample, not a bad row
    (b"good five", None),
    (None, "null"),
    (b"good seven", None),
    (b"cut off \xc3", "invalid_utf8"),
    (b"good nine", None),
]
#: The JSON Lines file, raw lines: rows 2..5 are all bad, so with shard_size 4 a whole shard is bad.
JSONL_ROWS = [
    (b'{"text": "json row zero is fine"}', None),
    (b'{"text": "json row one is fine too"}', None),
    (b'{"text": "a lone \\ud800 surrogate"}', "lone_surrogate"),
    (b'{"text": "unterminated', "invalid_json"),
    (b'{"text": 42}', "not_a_string"),
    (b'{"text": "bad \xff byte"}', "invalid_utf8"),
]
BASE_JSONL = len(PARQUET_ROWS)
EXPECTED_BAD = {i: why for i, (_, why) in enumerate(PARQUET_ROWS) if why} | {
    BASE_JSONL + i: why for i, (_, why) in enumerate(JSONL_ROWS) if why
}
N_ROWS = len(PARQUET_ROWS) + len(JSONL_ROWS)


def write_invalid_utf8_parquet(path: pathlib.Path, values: list[bytes | None]) -> pathlib.Path:
    """A parquet *string* column holding arbitrary bytes: parquet writers do not check UTF-8 (cast with safe=False)."""
    column = pa.array(values, type=pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"text": column, "id": pa.array([f"doc{i}" for i in range(len(values))])}), path)
    return path


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("bad-rows")
    parquet = write_invalid_utf8_parquet(root / "mixed.parquet", [value for value, _ in PARQUET_ROWS])
    jsonl = root / "mixed.jsonl"
    jsonl.write_bytes(b"".join(line + b"\n" for line, _ in JSONL_ROWS))
    return parquet, jsonl


def mixed_task(mixed_files, task_id: str = "t-mixed") -> dict:
    parquet, jsonl = mixed_files
    return {
        "id": task_id,
        "files": [
            {"path": str(parquet), "base": 0, "start": 0, "end": len(PARQUET_ROWS)},
            {"path": str(jsonl), "base": BASE_JSONL, "start": 0, "end": len(JSONL_ROWS)},
        ],
    }


def good_texts() -> dict[int, str]:
    texts = {i: v.decode() for i, (v, why) in enumerate(PARQUET_ROWS) if not why}
    texts |= {BASE_JSONL + i: json.loads(line)["text"] for i, (line, why) in enumerate(JSONL_ROWS) if not why}
    return texts


# -- reading: each awkward row kind is one bad row; the ids of the others do not move -----------------------


def test_the_invalid_utf8_fixture_really_breaks_a_whole_column_read(mixed_files):
    """The precondition of the next test: to_pylist of the column (the old reading) raises."""
    column = pq.read_table(mixed_files[0], columns=["text"]).column("text")
    with pytest.raises(UnicodeDecodeError):
        column.to_pylist()


def test_null_and_invalid_utf8_in_a_parquet_string_column_are_bad_rows_and_ids_stay_stable(mixed_files):
    task = Task.from_dict(mixed_task(mixed_files))
    docs = list(data.read_slice(task, "text"))
    assert [d.position for d in docs] == list(range(N_ROWS)) and [d.sample_id for d in docs] == list(range(N_ROWS))
    bad = {d.sample_id: d.bad.reason for d in docs if d.bad}
    # A lone surrogate is a valid Python string: the tokenizer, not the reader, finds it (next section).
    assert bad == {i: why for i, why in EXPECTED_BAD.items() if why != "lone_surrogate"}
    assert {d.sample_id: d.text for d in docs if not d.bad and "\ud800" not in d.text} == good_texts()
    latin = docs[2]
    assert (latin.url, latin.row) == (str(mixed_files[0]), 2) and "byte 3" in latin.bad.detail


def test_a_slice_starting_after_bad_rows_reads_the_same_rows(mixed_files):
    task = Task.from_dict(mixed_task(mixed_files))
    resumed = list(data.read_slice(task, "text", skip=7))
    full = list(data.read_slice(task, "text"))[7:]
    assert resumed == full


def test_a_corrupt_parquet_data_page_is_bad_input_not_a_retry(tmp_path, mixed_files):
    raw = bytearray(mixed_files[0].read_bytes())
    at = raw.find(b"The first good row.")
    raw[at - 24 : at + 8] = b"\x00" * 32  # the page header before the first value
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(bytes(raw))
    task = Task.from_dict({"id": "t", "files": [{"path": str(corrupt), "base": 0, "start": 0, "end": 3}]})
    with pytest.raises(BadInput, match="corrupt.parquet: the data after row 0 cannot be decoded"):
        list(data.read_slice(task, "text"))


def test_a_connection_error_while_reading_a_parquet_footer_stays_transient(mixed_files):
    """The other side of the previous test: a network failure (raised by the gs:// reader, a Python file
    object) must stay retryable (exit 75), never become a dead-lettering BadInput."""
    from extract.errors import EX_TEMPFAIL, exit_code_for

    class DroppedConnection(io.BytesIO):
        def read(self, *args):
            raise ConnectionError("connection reset by peer")

    with pytest.raises(ConnectionError) as failure:
        data._parquet_file("gs://b/mixed.parquet", DroppedConnection(mixed_files[0].read_bytes()))
    assert exit_code_for(failure.value) == EX_TEMPFAIL


def test_a_json_line_nested_too_deep_is_an_invalid_json_row_not_a_crash(tmp_path):
    rows = tmp_path / "deep.jsonl"
    rows.write_text('{"text": "fine"}\n' + "[" * 100_000 + "\n")
    task = Task.from_dict({"id": "t", "files": [{"path": str(rows), "base": 0, "start": 0, "end": 2}]})
    fine, deep = data.read_slice(task, "text")
    assert fine.text == "fine" and deep.bad.reason == "invalid_json"


def test_a_malformed_tokenizer_file_is_bad_input(tmp_path, tiny_models, corpus):
    import shutil
    import types

    from extract.consumer import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], model)
    (model / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))  # valid JSON, wrong schema
    engine = types.SimpleNamespace(model_dir=model, config=types.SimpleNamespace(vocab_size=1000))
    with pytest.raises(BadInput, match="^model: cannot load a tokenizer"):
        load_tokenizer(engine, Job.from_dict(base_job(model, corpus)))


def write_rows(path: pathlib.Path, records: list) -> Task:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return Task.from_dict({"id": "t", "files": [{"path": str(path), "base": 0, "start": 0, "end": len(records)}]})


#: One JSON row lacks the text key: a bad row of its own, not a wrong text_field.
ROWS_ONE_WITHOUT_TEXT = [{"text": "zero"}, {"id": "doc1", "body": "one"}, {"text": "two"}, {"text": None}]


def test_a_json_row_without_the_text_field_is_a_missing_field_bad_row(tmp_path):
    task = write_rows(tmp_path / "rows.jsonl", ROWS_ONE_WITHOUT_TEXT)
    docs = list(data.read_slice(task, "text"))
    assert [(d.sample_id, d.bad.reason if d.bad else d.text) for d in docs] == [
        (0, "zero"), (1, "missing_field"), (2, "two"), (3, "null")
    ]  # fmt: skip
    assert docs[1].bad.detail == "text_field 'text' is missing (keys: id, body)"


def test_a_json_slice_in_which_no_row_has_the_text_field_is_bad_input(tmp_path):
    task = write_rows(tmp_path / "rows.jsonl", [{"body": "zero"}, {"body": "one"}, [1, 2]])
    with pytest.raises(BadInput, match=r"^text_field: 'text' is in no row \(0\.\.2\) of .*rows\.jsonl"):
        list(data.read_slice(task, "text"))
    # A resumed attempt starts inside the slice and has not seen its first rows: it does not judge.
    assert [d.bad.reason for d in data.read_slice(task, "text", skip=1)] == ["missing_field", "not_an_object"]


def test_a_text_field_in_no_row_of_the_tasks_last_json_file_is_bad_input_once_batched(tmp_path, tiny_models):
    """The check runs when the file's rows end; batching reads no further than the slice, so it must pull the reader
    to its end itself, or the task's last file is never judged (issue 30: exit 0 with every row skipped)."""
    task = write_rows(tmp_path / "rows.jsonl", [{"body": "zero"}, {"body": "one"}, {"body": "two"}])
    with pytest.raises(BadInput, match=r"^text_field: 'text' is in no row \(0\.\.2\) of .*rows\.jsonl"):
        _batches(Tokenizer(tiny_models["qwen2"], 128), task)


def test_a_parquet_file_without_the_text_column_stays_bad_input(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": ["zero", "one"]}), path)
    task = Task.from_dict({"id": "t", "files": [{"path": str(path), "base": 0, "start": 0, "end": 2}]})
    with pytest.raises(BadInput, match=r"^text_field: 'text' is not a column of .*rows\.parquet \(columns: body\)"):
        list(data.read_slice(task, "text"))
    with pytest.raises(BadInput, match=r"^text_field: 'text' is not a column"):
        data.check_task_files(task, "text")


# -- tokenising: refused text is a bad row; fail mode names file, row and reason ------------------------------


def _batches(tokenizer, task: Task, on_bad_row: str = "skip", shard_size: int = 4) -> list:
    return list(
        batches_for_slice(data.read_slice(task, "text"), tokenizer, start=0, end=task.num_samples, batch_size=4,
                          shard_size=shard_size, buckets=(16, 128), on_bad_row=on_bad_row)
    )  # fmt: skip


def test_a_lone_surrogate_in_jsonl_is_refused_by_the_tokenizer_and_skipped(tiny_models, mixed_files):
    tokenizer = Tokenizer(tiny_models["qwen2"], 128)
    task = Task.from_dict(mixed_task(mixed_files))
    batches = _batches(tokenizer, task)
    skipped = {d.sample_id: d for b in batches for d in b.skipped}
    assert {i: d.bad.reason for i, d in skipped.items()} == EXPECTED_BAD
    assert "'\\ud800' at character 7" in skipped[BASE_JSONL + 2].bad.detail
    # The good rows are tokenised exactly as on their own, and every position is accounted for once.
    samples = {s.sample_id: s for b in batches for s in (*b.samples, *b.empty)}
    assert sorted([*samples, *skipped]) == list(range(N_ROWS))
    for sample_id, text in good_texts().items():
        assert samples[sample_id].token_ids.tolist() == tokenizer.encode([text])[0].tolist()


class _RefusingTokenizer(Tokenizer):
    """The real tokenizer, except that it raises, as the tokenizers library does for input it cannot encode,
    on any text holding REFUSED: no real Qwen tokenizer refuses a valid string, but a job's may."""

    REFUSED = "\x00refuse\x00"

    def encode(self, texts):
        for text in texts:
            if self.REFUSED in text:
                raise RuntimeError("pre-tokenizer failed on this input")
        return super().encode(texts)


def test_text_the_tokenizer_refuses_is_an_untokenizable_bad_row(tmp_path, tiny_models):
    rows = tmp_path / "rows.jsonl"
    refused = f"so {_RefusingTokenizer.REFUSED} not"
    texts = ["fine zero", refused, "fine two", "fine three", "fine four", refused, "fine six"]
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task = Task.from_dict({"id": "t", "files": [{"path": str(rows), "base": 100, "start": 0, "end": len(texts)}]})
    tokenizer = _RefusingTokenizer(tiny_models["qwen2"], 128)
    batches = _batches(tokenizer, task, shard_size=len(texts))
    skipped = [d for b in batches for d in b.skipped]
    assert [(d.sample_id, d.bad.reason) for d in skipped] == [(101, "untokenizable"), (105, "untokenizable")]
    assert "RuntimeError: pre-tokenizer failed" in skipped[0].bad.detail
    samples = {s.sample_id: s.token_ids.tolist() for b in batches for s in b.samples}
    assert samples == {100 + i: tokenizer.encode([t])[0].tolist() for i, t in enumerate(texts) if t != refused}


def test_fail_mode_raises_bad_input_naming_the_file_the_row_and_the_reason(tiny_models, mixed_files):
    task = Task.from_dict(mixed_task(mixed_files))
    with pytest.raises(BadInput) as failure:
        _batches(Tokenizer(tiny_models["qwen2"], 128), task, on_bad_row="fail")
    message = str(failure.value)
    assert message.startswith(f"data file {mixed_files[0]}: row 1 (sample id 1) is a bad row, null:")
    assert '"on_bad_row": "skip"' in message


def test_on_bad_row_defaults_to_skip_and_rejects_other_values(tiny_models, corpus):
    assert Job.from_dict(base_job(tiny_models["qwen2"], corpus)).on_bad_row == "skip"
    assert Job.from_dict(base_job(tiny_models["qwen2"], corpus, on_bad_row="fail")).on_bad_row == "fail"
    with pytest.raises(BadInput, match='^on_bad_row: must be "skip" .* or "fail" .*, got .ignore.$'):
        Job.from_dict(base_job(tiny_models["qwen2"], corpus, on_bad_row="ignore"))


# -- writing: skipped rows hold positions, shards may be empty, the listing is bounded per task -------------


def test_a_shard_of_only_skipped_rows_is_an_empty_readable_shard_and_lists_are_bounded(tmp_path):
    """A writer fed nothing but bad rows: every record names an empty shard; at most MAX_LISTED_SKIPPED are listed
    over the task's attempts, and every skipped row is counted."""
    from extract.batching import Batch

    def bad_docs(lo: int, hi: int) -> tuple:
        return tuple(data.Document(p, 1000 + p, "", url="x.parquet", row=p, bad=data.BadRow("null", "null")) for p in range(lo, hi))

    listed_before = MAX_LISTED_SKIPPED - 30
    shard_size, end = 40, 120
    store = objectstore.open_store(str(tmp_path / "out"))
    writer = ShardWriter(store=store, layers=(1, 2), out_dtype=np.dtype(np.float32), start=0, end=end,
                         shard_size=shard_size, metadata={"hidden_size": "8"}, progress=ProgressLog(None),
                         listed_skipped=listed_before)  # fmt: skip
    for lo in range(0, end, 20):
        writer.submit(Batch(samples=(), token_ids=None, skipped=bad_docs(lo, lo + 20)), {})
    records = writer.finish()
    assert [r["counters"] for r in records] == [{"skipped_rows": shard_size}] * 3
    assert [len(r["skipped"]) for r in records] == [30, 0, 0]
    assert records[0]["skipped"][0] == {"sample_id": 1000, "file": "x.parquet", "row": 0, "reason": "null", "detail": "null"}
    assert records[-1]["stats"]["samples"] == 0 and records[-1]["stats"]["skipped_rows"] == end
    acts = open_activations(str(tmp_path / "out"))
    assert acts.num_samples == 0 and acts.num_tokens == 0 and acts.layer(2).shape == (0, 8)
    assert list(acts.samples()) == []
    resume = ResumeState.from_dict({"progress": records}, Task.from_dict({"id": "t", "files": [
        {"path": "x.parquet", "start": 0, "end": end}]}))  # fmt: skip
    assert resume.committed == end and resume.listed_skipped == 30


# -- consume.py as a subprocess -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory, tiny_models, corpus, mixed_files, run_consume) -> ConsumeRun:
    workdir = tmp_path_factory.mktemp("skip-run")
    spec = ConsumeRun(
        workdir=workdir,
        job=base_job(tiny_models["qwen2"], corpus, data_files=[str(p) for p in mixed_files], shard_size=4),
        task=mixed_task(mixed_files),
        output=str(workdir / "out"),
    )
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr
    return spec


def test_skip_mode_extracts_the_good_rows_and_records_each_bad_row_with_its_reason(skip_run, mixed_files):
    records = skip_run.records()
    assert [(r["sample_start"], r["sample_end"]) for r in records] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    listed = [entry for r in records for entry in r.get("skipped", [])]
    assert {e["sample_id"]: e["reason"] for e in listed} == EXPECTED_BAD
    assert sum(r.get("counters", {}).get("skipped_rows", 0) for r in records) == len(EXPECTED_BAD)
    assert records[-1]["stats"]["skipped_rows"] == len(EXPECTED_BAD)
    assert records[-1]["stats"]["samples"] == N_ROWS - len(EXPECTED_BAD)
    surrogate = next(e for e in listed if e["reason"] == "lone_surrogate")
    assert (surrogate["file"], surrogate["row"]) == (str(mixed_files[1]), 2)
    # The last shard covers four bad rows only: it exists and holds no sample.
    assert records[-1]["samples"] == 0 and records[-1]["tokens"] == 0
    assert skip_run.stderr_file.read_text().count("event=row_skipped") == len(EXPECTED_BAD)

    acts = open_activations(skip_run.output)
    samples = {s.sample_id: s for s in acts.samples()}
    assert sorted(samples) == sorted(good_texts())


def test_a_json_row_without_the_text_field_is_skipped_not_a_dead_letter(tmp_path, tiny_models, corpus, run_consume):
    rows = tmp_path / "rows.jsonl"
    write_rows(rows, ROWS_ONE_WITHOUT_TEXT)
    spec = ConsumeRun(
        workdir=tmp_path,
        job=base_job(tiny_models["qwen2"], corpus, data_files=[str(rows)], shard_size=4),
        task={"id": "t-missing", "files": [{"path": str(rows), "base": 0, "start": 0, "end": 4}]},
        output=str(tmp_path / "out"),
    )
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr
    [record] = spec.records()
    assert [(e["sample_id"], e["reason"]) for e in record["skipped"]] == [(1, "missing_field"), (3, "null")]
    assert sorted(s.sample_id for s in open_activations(spec.output).samples()) == [0, 2]


def test_good_rows_next_to_bad_ones_get_the_activations_of_a_clean_run(
    skip_run, tmp_path, tiny_models, corpus, run_consume
):
    clean = tmp_path / "clean.jsonl"
    texts = good_texts()
    clean.write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in sorted(texts)))
    spec = ConsumeRun(
        workdir=tmp_path,
        job=base_job(tiny_models["qwen2"], corpus, data_files=[str(clean)], shard_size=4),
        task={"id": "t-clean", "files": [{"path": str(clean), "base": 0, "start": 0, "end": len(texts)}]},
        output=str(tmp_path / "out"),
    )
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr
    assert not any("skipped" in r for r in spec.records())
    reference = [s for s in open_activations(spec.output).samples()]
    mixed = [s for s in open_activations(skip_run.output).samples()]
    assert [s.sample_id for s in mixed] == sorted(texts)
    for want, got in zip(reference, mixed, strict=True):
        assert got.token_ids.tolist() == want.token_ids.tolist()
        for layer in want.layers:
            np.testing.assert_allclose(got.layers[layer].astype(np.float32), want.layers[layer].astype(np.float32),
                                       rtol=1e-2, atol=1e-2)  # fmt: skip


def test_a_resumed_run_skips_the_same_rows_and_records_each_once(skip_run, tmp_path, run_consume):
    first_two = skip_run.records()[:2]
    spec = ConsumeRun(workdir=tmp_path, job=skip_run.job, task=skip_run.task, output=str(tmp_path / "out"),
                      resume={"task": skip_run.task["id"], "attempt": 2, "progress": first_two})  # fmt: skip
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr
    rest = spec.records()
    assert [(r["sample_start"], r["sample_end"]) for r in rest] == [(8, 12), (12, 16)]
    union = [e["sample_id"] for r in first_two + rest for e in r.get("skipped", [])]
    assert sorted(union) == sorted(EXPECTED_BAD)
    assert [r.get("skipped") for r in rest] == [r.get("skipped") for r in skip_run.records()[2:]]


def test_fail_mode_exits_65_naming_the_file_the_row_and_the_reason(tmp_path, tiny_models, corpus, mixed_files,
                                                                    run_consume):  # fmt: skip
    parquet, jsonl = mixed_files
    task = {"id": "t-fail", "files": [{"path": str(jsonl), "base": BASE_JSONL, "start": 0, "end": len(JSONL_ROWS)}]}
    spec = ConsumeRun(workdir=tmp_path, job=base_job(tiny_models["qwen2"], corpus, on_bad_row="fail", shard_size=4),
                      task=task, output=str(tmp_path / "out"))  # fmt: skip
    proc = run_consume(spec)
    assert proc.returncode == 65, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert f"data file {jsonl}: row 2 (sample id {BASE_JSONL + 2}) is a bad row, lone_surrogate:" in line
    assert "Traceback" not in proc.stderr
    # The bad row is in the first shard's window, so nothing was stored.
    assert spec.records() == [] and not list((tmp_path / "out").glob("*.safetensors"))


def test_a_typo_in_text_field_exits_65_when_the_json_file_is_the_tasks_only_one(tmp_path, tiny_models, corpus,
                                                                                 run_consume):  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    write_rows(rows, [{"text": "zero"}, {"text": "one"}])
    spec = ConsumeRun(workdir=tmp_path, job=base_job(tiny_models["qwen2"], corpus, data_files=[str(rows)],
                                                     text_field="txt", shard_size=4),
                      task={"id": "t-typo", "files": [{"path": str(rows), "base": 0, "start": 0, "end": 2}]},
                      output=str(tmp_path / "out"))  # fmt: skip
    proc = run_consume(spec)
    assert proc.returncode == 65, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert f"text_field: 'txt' is in no row (0..1) of {rows}" in line


# A task of which every row is bad runs through spawn.py, status and merge in tests/e2e/test_bad_rows_pipeline.py.
