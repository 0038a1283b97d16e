"""consume.py as two processes of one JAX program (a simulated 2-host slice) against one process on 4 devices."""

from __future__ import annotations

import subprocess

import pytest

from extract.job import Task
from extract.multihost import committed_spans, host_share, pending_blocks
from tests.extract_pipeline.conftest import REPO, ConsumeRun
from tests.slice.conftest import ALL_ROWS, HOST_XLA_FLAGS, assert_same_samples, samples_by_id, slice_job

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


def test_two_process_slice_data_parallel_matches_one_process_and_process_0_gathers_every_record(
    tmp_path, tiny_models, corpus, consume_env, coordinator, reference
):
    # No mesh: the tiny model fits one device, so the automatic layout is data parallel over all 4 devices.
    job = slice_job(tiny_models, corpus)
    task = {"id": "t000000", "files": corpus.slice_files(ALL_ROWS)}
    output = str(tmp_path / "slice-out")
    hosts = [ConsumeRun(workdir=tmp_path / f"host{i}", job=job, task=task, output=output) for i in range(2)]
    procs = [start_host(spec, consume_env(), i, 2, coordinator) for i, spec in enumerate(hosts)]
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    assert codes == [0, 0], "\n".join(spec.stderr_file.read_text()[-3000:] for spec in hosts)

    # Process 0's progress file holds every host's shards (the one the leader's lease commits).
    records = hosts[0].records()
    assert sorted((r["sample_start"], r["sample_end"]) for r in records) == [
        (start, min(start + 16, 220)) for start in range(0, 220, 16)
    ]
    assert [r["sample_end"] for r in records if r.get("final")] == [220]
    assert not hosts[1].records()
    # Each host read and wrote only its own half of the blocks.
    assert "ranges=0-112 " in hosts[0].stderr_file.read_text()
    assert "ranges=112-220 " in hosts[1].stderr_file.read_text()
    assert "mesh=data=4,model=1" in hosts[0].stderr_file.read_text()
    assert_same_samples(samples_by_id(output), reference)
