"""`make run`'s pipeline with token sampling (TOKEN_SAMPLE, DROP_FIRST): workers, status and merge report stored
tokens beside processed ones; the reader, the statistics, the training loader and the SAELens export read the
sampled shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from activations.format import LayerStats
from activations.sampling import TokenSampling
from tests.workers import REPO


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("sampled-run") / "run"
    env = {**os.environ, "LOCAL_RUN_DIR": str(work), "WORKERS": "2", "ROWS_PER_TASK": "80", "TOKEN_SAMPLE": "0.25",
           "DROP_FIRST": "1"}  # fmt: skip
    result = subprocess.run([sys.executable, "tools/local_run.py"], cwd=REPO, capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return work, result.stdout


def test_status_and_merge_report_stored_tokens_beside_processed(sampled_run):
    work, stdout = sampled_run
    assert "read back 320 samples" in stdout
    index = json.loads((work / "queue" / "index.json").read_text())
    totals = index["totals"]
    assert totals["stored_tokens"] == totals["tokens"] and 0.15 < totals["tokens"] / totals["processed_tokens"] < 0.3
    assert f"sampled: {totals['tokens']} tokens stored of {totals['processed_tokens']} processed" in stdout
    status = subprocess.run([sys.executable, "tools/status.py", str(work / "queue")], cwd=REPO, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert f"processed_tokens={totals['processed_tokens']}" in status.stdout
    assert f"stored_tokens={totals['stored_tokens']}" in status.stdout


def test_reader_statistics_and_loader_agree_on_the_sampled_tokens(sampled_run):
    from activations.loader import ActivationLoader
    from activations.reader import open_activations

    work, _ = sampled_run
    queue = str(work / "queue")
    acts = open_activations(queue)
    assert acts.sampled
    sampling = TokenSampling(0.25, 1, 0)
    offsets, positions = acts.offsets(), acts.positions()
    for k, sample_id in enumerate(acts.sample_ids()):
        stored = positions[offsets[k] : offsets[k + 1]]
        assert stored.tolist() == [p for p in sampling.kept(int(sample_id), 10**4) if p < 128][: len(stored)]
    assert positions.min() >= 1  # drop_first
    layer = acts.layers[0]
    rows = acts.layer(layer)
    # The index's statistics are those of exactly the stored tokens.
    index = json.loads((work / "queue" / "index.json").read_text())
    recorded = LayerStats.from_json(index["stats"][f"layer_{layer}"], "index")
    direct = LayerStats.of(rows)
    assert recorded.tokens == direct.tokens == len(rows)
    np.testing.assert_allclose(recorded.sum, direct.sum, rtol=1e-9, atol=1e-9)
    # The loader streams every stored row once per epoch; its positions filter reads the shards' positions.
    with ActivationLoader(queue, layers=layer, batch_size=64, shuffle=False, normalize="mean_norm") as loader:
        streamed = sum(len(batch) for batch in loader)
    assert streamed == len(rows)
    with ActivationLoader(queue, layers=layer, batch_size=64, shuffle=False, positions=(0, 8),
                          return_token_ids=True) as loader:  # fmt: skip
        early = np.concatenate([ids for _, ids in loader])
    assert np.array_equal(early, acts.token_ids()[positions < 8])
    with ActivationLoader(queue, layers=layer, batch_size=64, shuffle_tokens=256, drop_first=4) as loader:
        kept = loader.kept_stats()[layer]
    assert kept.tokens == int((positions >= 4).sum())


def test_saelens_export_reads_sampled_shards(sampled_run, tmp_path):
    from activations.reader import open_activations

    work, _ = sampled_run
    queue = str(work / "queue")
    layer = open_activations(queue).layers[0]
    out = tmp_path / "saelens"
    result = subprocess.run([sys.executable, "tools/export.py", queue, "--format", "saelens", str(out), "--layer",
                             str(layer), "--context-size", "16"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    acts = open_activations(queue)
    assert summary["rows"] == acts.num_tokens // 16 and summary["sampled"] is True
    import datasets

    dataset = datasets.load_from_disk(str(out))
    first = np.asarray(dataset[0][summary["hook"]], np.float32)
    assert np.array_equal(first, np.asarray(acts.layer(layer)[:16], np.float32))
