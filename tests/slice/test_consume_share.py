"""consume.py as two processes of one JAX program (a simulated 2-host slice) against one process on 4 devices."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from extract.job import Task
from extract.multihost import committed_spans, host_share, pending_blocks
from extract.reader import open_activations
from tests.extract_pipeline.conftest import REPO, ConsumeRun, base_job
from tests.slice.conftest import HOST_XLA_FLAGS

#: 80 samples across two file boundaries: 5 shards of 16.
SLICE = [(0, 70, 90), (1, 0, 50), (2, 0, 10)]
TIMEOUT_S = 240


def start_host(spec: ConsumeRun, env: dict, index: int, hosts: int, coordinator: str) -> subprocess.Popen:
    spec.workdir.mkdir(parents=True, exist_ok=True)
    slice_env = {
        **env,
        "XLA_FLAGS": HOST_XLA_FLAGS,
        "SPAWN_SLICE_HOSTS": str(hosts),
        "SPAWN_HOST_INDEX": str(index),
        "SPAWN_COORDINATOR": coordinator,
        "SPAWN_SLICE_HEARTBEAT_TIMEOUT": "5",
    }
    stderr = open(spec.stderr_file, "w")
    proc = subprocess.Popen(spec.argv(), cwd=REPO, env=slice_env, stderr=stderr, stdout=subprocess.DEVNULL)
    stderr.close()
    return proc


def samples_by_id(output: str) -> dict[int, tuple[np.ndarray, dict[int, np.ndarray]]]:
    acts = open_activations(output)
    out = {}
    for sample in acts.samples():
        assert sample.sample_id not in out, f"sample {sample.sample_id} stored twice"
        out[sample.sample_id] = (sample.token_ids, {k: np.asarray(v, np.float32) for k, v in sample.layers.items()})
    return out


@pytest.mark.parametrize("blocks", [5, 6, 1])
def test_host_shares_are_disjoint_and_cover_the_pending_blocks(blocks):
    pending = [(16 * k, 16 * k + 16) for k in range(blocks)]
    for hosts in (1, 2, 3, 4):
        shares = [host_share(pending, h, hosts) for h in range(hosts)]
        positions = [p for share in shares for start, end in share for p in range(start, end)]
        assert sorted(positions) == list(range(16 * blocks)), (hosts, shares)
        assert len(positions) == len(set(positions))
        sizes = [sum(end - start for start, end in share) for share in shares]
        assert max(sizes) - min(sizes) <= 16  # balanced to within one block


def test_resume_skips_every_committed_block_even_with_gaps():
    task = Task.from_dict({"id": "t1", "files": [{"path": "x", "start": 0, "end": 75}]})
    records = [{"sample_start": 16, "sample_end": 32}, {"sample_start": 64, "sample_end": 75}]
    spans = committed_spans(records, task)
    assert pending_blocks(75, 16, spans) == [(0, 16), (32, 48), (48, 64)]
    assert host_share(pending_blocks(75, 16, spans), 0, 2) == [(0, 16), (32, 48)]
    assert host_share(pending_blocks(75, 16, spans), 1, 2) == [(48, 64)]


def test_two_process_slice_with_the_model_split_across_hosts_matches_one_process(
    tmp_path, tiny_models, corpus, run_consume, consume_env, coordinator
):
    job = base_job(tiny_models["qwen2"], corpus, mesh="model=4", dtype="fp32", compute_dtype="fp32")
    task = {"id": "t000001", "files": corpus.slice_files(SLICE)}
    reference = ConsumeRun(workdir=tmp_path / "reference", job=job, task=task, output=str(tmp_path / "ref-out"))
    done = run_consume(reference)
    assert done.returncode == 0, done.stderr

    output = str(tmp_path / "slice-out")
    hosts = [ConsumeRun(workdir=tmp_path / f"host{i}", job=job, task=task, output=output) for i in range(2)]
    procs = [start_host(spec, consume_env(), i, 2, coordinator) for i, spec in enumerate(hosts)]
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    assert codes == [0, 0], "\n".join(spec.stderr_file.read_text()[-3000:] for spec in hosts)

    # Process 0's progress file holds every host's shards (the one the leader's lease commits).
    records = hosts[0].records()
    assert sorted((r["sample_start"], r["sample_end"]) for r in records) == [(16 * k, 16 * k + 16) for k in range(5)]
    assert sum(1 for r in records if r.get("final")) == 1
    assert not hosts[1].records()
    # Each host wrote its own shards: the share logs name disjoint ranges.
    assert "ranges=0-48" in hosts[0].stderr_file.read_text() and "ranges=48-80" in hosts[1].stderr_file.read_text()

    expected, got = samples_by_id(reference.output), samples_by_id(output)
    assert sorted(got) == sorted(expected)
    for sample_id, (tokens, layers) in expected.items():
        np.testing.assert_array_equal(got[sample_id][0], tokens)
        for layer, values in layers.items():
            np.testing.assert_allclose(got[sample_id][1][layer], values, rtol=1e-5, atol=1e-5)
    metas = {json.dumps(open_activations(r["shard"]).metadata["job"], sort_keys=True) for r in records}
    assert len(metas) == 1
