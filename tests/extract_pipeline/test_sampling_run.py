"""Token sampling at write time (job.token_sample, drop_first): which positions are stored depends on (seed, sample
id, position) alone, and what is stored is bit for bit what the unsampled run computed at those positions.

Each batching configuration (batch size, packing) runs once unsampled and once sampled with the same engine: the
stored positions must be the same in every configuration (and equal a plain-Python splitmix64 written here), and
the stored activations and token ids must equal the unsampled run's at those positions, bitwise. A run killed with
SIGKILL and resumed from its committed records stores the same positions and activations as an uninterrupted one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from extract.consumer import RunInputs, load_engine, run
from extract.job import Job, Task
from activations.reader import open_activations
from tests.extract_pipeline.conftest import base_job, killed_after_two_shards, write_json

SAMPLING = {"token_sample": 0.3, "drop_first": 2, "sample_seed": 7}
#: 60 samples over two files; shards of 16 samples.
SLICE = [(0, 30, 70), (1, 0, 20)]


def reference_kept(seed: int, sample_id: int, n_tokens: int, fraction: float, drop_first: int) -> list[int]:
    """The sampling rule in plain Python integers (activations/sampling.py's docstring), independent of numpy."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    document = mix(mix(seed) ^ sample_id)
    return [p for p in range(drop_first, n_tokens) if (mix(document ^ p) >> 11) < fraction * 2**53]


def by_sample(acts) -> dict[int, tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]]:
    """sample id -> (positions, token ids, layer -> rows as raw bits)."""
    return {s.sample_id: (np.asarray(s.positions), s.token_ids, {k: v.view(np.uint16) for k, v in s.layers.items()})
            for s in acts.samples()}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_models, corpus):
    """(batch_size, packing) -> (unsampled, sampled) outputs of the same task, each configuration on one engine."""
    root = tmp_path_factory.mktemp("sampling")
    task = Task.from_dict({"id": "t000001", "files": corpus.slice_files(SLICE)})
    outputs = {}
    for batch_size, packing in ((4, False), (4, True), (2, False)):
        spec = base_job(tiny_models["qwen2"], corpus, batch_size=batch_size, packing=packing)
        engine = load_engine(Job.from_dict(spec))
        pair = []
        for sampled in (False, True):
            job = Job.from_dict({**spec, **(SAMPLING if sampled else {})})
            out = root / f"b{batch_size}-p{int(packing)}-s{int(sampled)}"
            result = run(RunInputs(job=job, task=task, output_url=str(out)), engine=engine)
            pair.append((str(out), result.records))
        outputs[batch_size, packing] = pair
    return outputs


def test_sampled_positions_follow_the_rule_and_do_not_depend_on_batching_or_packing(runs):
    stored = {}
    for config, (_, (sampled, records)) in runs.items():
        acts = open_activations(sampled)
        assert acts.sampled and acts.metadata["format"] == "activations/v2"
        assert json.loads(json.dumps(acts.metadata["sampling"])) == {"token_sample": 0.3, "drop_first": 2, "seed": 7}
        stored[config] = {sample_id: positions for sample_id, (positions, _, _) in by_sample(acts).items()}
        assert sum(r["tokens"] for r in records) == acts.num_tokens
        assert all(r["counters"]["stored_tokens"] == r["tokens"] for r in records)
    first, *others = stored.values()
    assert all(other.keys() == first.keys() for other in others)
    for sample_id in first:
        assert all(np.array_equal(other[sample_id], first[sample_id]) for other in others), sample_id
    # Against the rule written out in plain integers, for every document's processed length.
    unsampled = by_sample(open_activations(runs[4, False][0][0]))
    assert unsampled.keys() == first.keys()
    kept = total = 0
    for sample_id, (positions, token_ids, _) in unsampled.items():
        expected = reference_kept(7, sample_id, len(token_ids), 0.3, 2)
        assert first[sample_id].tolist() == expected, sample_id
        kept, total = kept + len(expected), total + max(0, len(token_ids) - 2)
    assert 0.2 < kept / total < 0.4  # about token_sample of the positions past drop_first


def test_sampled_activations_are_the_unsampled_runs_at_those_positions_bitwise(runs):
    for config, ((plain, plain_records), (sampled, sampled_records)) in runs.items():
        whole, part = by_sample(open_activations(plain)), by_sample(open_activations(sampled))
        assert whole.keys() == part.keys()
        for sample_id, (positions, token_ids, layers) in part.items():
            all_positions, all_ids, all_layers = whole[sample_id]
            assert np.array_equal(all_positions, np.arange(len(all_ids)))  # unsampled: every position, in order
            assert np.array_equal(token_ids, all_ids[positions])
            for layer, rows in layers.items():
                assert np.array_equal(rows, all_layers[layer][positions]), (config, sample_id, layer)
        # The records count what was processed beside what was stored.
        processed = sum(r["counters"]["processed_tokens"] for r in sampled_records)
        assert processed == sum(r["tokens"] for r in plain_records) == sampled_records[-1]["stats"]["tokens"]
        assert sampled_records[-1]["stats"]["stored_tokens"] == sum(r["tokens"] for r in sampled_records) < processed


def test_sampled_shards_are_cut_by_stored_bytes(runs):
    """shard_size cuts both runs alike (16 samples); a sampled shard is smaller by the tokens it leaves out."""
    (_, plain), (_, sampled) = runs[4, False]
    assert [(r["sample_start"], r["sample_end"]) for r in plain] == [(r["sample_start"], r["sample_end"]) for r in sampled]
    assert sum(r["bytes"] for r in sampled) < 0.5 * sum(r["bytes"] for r in plain)


def test_sampled_run_resumed_after_sigkill_stores_the_same_positions_and_activations(
    tmp_path, tiny_models, corpus, runs, start_consume, run_consume, gcs, gcs_bucket, gcs_client
):
    job = {**base_job(tiny_models["qwen2"], corpus), **SAMPLING}
    task = {"id": "t000001", "files": corpus.slice_files(SLICE)}
    committed, second = killed_after_two_shards(tmp_path, job, task, gcs, gcs_bucket, start_consume)
    assert len(committed) < 4
    done = run_consume(second)
    assert done.returncode == 0, done.stderr
    resumed = second.records()
    assert resumed[0]["sample_start"] == committed[-1]["sample_end"] and resumed[-1]["final"]
    marker = write_json(tmp_path / "done" / "t000001.json", {"task": "t000001", "outputs": committed + resumed})
    got = by_sample(open_activations(str(marker)))
    want = by_sample(open_activations(runs[4, False][1][0]))  # the uninterrupted sampled run, same batching
    assert got.keys() == want.keys()
    for sample_id, (positions, token_ids, layers) in got.items():
        assert np.array_equal(positions, want[sample_id][0]) and np.array_equal(token_ids, want[sample_id][1])
        for layer, rows in layers.items():
            assert np.array_equal(rows, want[sample_id][2][layer]), (sample_id, layer)


def test_fp8_run_stores_the_bf16_runs_activations_quantised_per_token(tmp_path, tiny_models, corpus, runs):
    """dtype fp8 through consume's run loop: the engine hands bf16, the writer stores e4m3 and a scale per token."""
    from activations.format import quantize_per_token

    task = Task.from_dict({"id": "t000001", "files": corpus.slice_files(SLICE)})
    job = Job.from_dict({**base_job(tiny_models["qwen2"], corpus), **SAMPLING, "dtype": "fp8"})
    run(RunInputs(job=job, task=task, output_url=str(tmp_path / "fp8")))
    acts = open_activations(str(tmp_path / "fp8"))
    assert next(acts.iter_shards()).tensors["layer_1"].dtype.name == "float8_e4m3fn"
    plain = {s.sample_id: s for s in open_activations(runs[4, False][0][0]).samples()}
    for sample in acts.samples():
        reference = plain[sample.sample_id]
        for layer, rows in sample.layers.items():
            values, scale = quantize_per_token(reference.layers[layer][sample.positions])
            assert np.array_equal(rows, values.astype(np.float32) * scale[:, None]), (sample.sample_id, layer)
