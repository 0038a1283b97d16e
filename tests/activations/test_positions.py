"""Each row's position in its document comes with its token id (`return_positions`): a sampled job's stored
`positions`, an unsampled job's offsets in its documents; and a shard whose metadata records sampling but holds no
`positions` is refused, naming it, instead of being read as a shard of every position (#38: 2,118 rows instead of
2,132, some of them the wrong ones)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from activations.format import FORMAT_SAMPLED, POSITIONS
from activations.io import ActivationsError
from activations.loader import ActivationLoader
from activations.reader import open_activations
from tests.activations.conftest import SampledJob, Written
from tests.activations.test_loader_errors import rewrite


def streamed(loader: ActivationLoader) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(each batch's token numbers, every row's token id, every row's position), in stream order."""
    numbers, ids, positions = [], [], []
    for rows, batch_ids, batch_positions in loader:
        numbers.append(Written.row_key(rows))
        ids.append(batch_ids)
        positions.append(batch_positions)
    return numbers, np.concatenate(ids), np.concatenate(positions)


def test_rows_of_a_sampled_job_come_with_their_stored_positions(sampled: SampledJob):
    loader = ActivationLoader(str(sampled.root), layers=1, batch_size=8, shuffle_tokens=32, seed=1, epochs=2,
                              return_positions=True)  # fmt: skip
    numbers, ids, positions = streamed(loader)
    stream = np.concatenate(numbers)
    assert len(stream) == 2 * len(sampled.stored) and len(sampled.stored) < len(sampled.token_ids)
    for epoch in np.split(stream, 2):
        assert np.array_equal(np.sort(epoch), sampled.stored)
    assert np.array_equal(ids, sampled.token_ids[stream])
    assert np.array_equal(positions, sampled.positions[stream])
    assert positions.min() >= 1  # drop_first 1: no document's first position was stored
    assert positions.dtype == np.int32 and ids.dtype == np.int32


def test_rows_of_an_unsampled_job_come_with_their_offsets_in_their_documents(written: Written):
    loader = ActivationLoader(str(written.root), layers=3, batch_size=8, shuffle_tokens=32, seed=2,
                              return_positions=True, drop_first=1)  # fmt: skip
    numbers, ids, positions = streamed(loader)
    stream = np.concatenate(numbers)
    assert np.array_equal(np.sort(stream), np.flatnonzero(written.positions >= 1))
    assert np.array_equal(ids, written.token_ids[stream])
    assert np.array_equal(positions, written.positions[stream])


def test_unshuffled_positions_are_the_readers(sampled: SampledJob):
    acts = open_activations(str(sampled.root))
    with ActivationLoader(str(sampled.root), layers=1, batch_size=16, shuffle=False, return_positions=True,
                          output="torch") as loader:  # fmt: skip
        batches = list(loader)
    assert np.array_equal(np.concatenate([p.numpy() for _, _, p in batches]), acts.positions())
    assert np.array_equal(np.concatenate([t.numpy() for _, t, _ in batches]), acts.token_ids())


def test_positions_resume_exactly_from_every_checkpoint(sampled: SampledJob):
    def make() -> ActivationLoader:
        return ActivationLoader(str(sampled.root), layers=1, batch_size=6, shuffle_tokens=20, seed=4, epochs=2,
                                hold=0.5, dtype="bfloat16", return_positions=True, readahead=1, threads=1)  # fmt: skip

    loader, states, batches = make(), [], []
    states.append(json.loads(json.dumps(loader.state_dict())))
    for rows, ids, positions in loader:
        batches.append((np.array(rows).view(np.uint16), ids.copy(), positions.copy()))
        states.append(json.loads(json.dumps(loader.state_dict())))
    assert len(batches) > 40
    for checkpoint, state in enumerate(states):
        with make() as resumed:
            resumed.load_state_dict(state)
            rest = [(np.array(rows).view(np.uint16), ids, positions) for rows, ids, positions in resumed]
        assert len(rest) == len(batches) - checkpoint
        for got, want in zip(rest, batches[checkpoint:]):
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), f"resumed after batch {checkpoint}"


@pytest.fixture
def copied(sampled: SampledJob, tmp_path):
    """The sampled job's shards copied, to be damaged."""
    shutil.copytree(sampled.root / "out", tmp_path / "out")
    return sorted((tmp_path / "out").rglob("*.safetensors"))


@pytest.mark.parametrize("recorded", ["sampling", "format"])
def test_a_sampled_shard_without_positions_is_refused_naming_it(copied, recorded):
    def drop_positions(tensors, metadata):
        assert metadata["format"] == FORMAT_SAMPLED and "sampling" in metadata
        del tensors[POSITIONS]
        if recorded == "format":  # the format alone says the shard is sampled
            del metadata["sampling"]

    victim = copied[2]
    rewrite(victim, drop_positions)
    source = str(copied[0].parent.parent)
    refused = f"shard {victim}: its metadata records token sampling .* but it holds no 'positions' tensor"
    # With the filters that read positions, and without: the shard is refused, not read as if unsampled.
    with pytest.raises(ActivationsError, match=refused):
        list(ActivationLoader(source, layers=1, batch_size=8, shuffle=False, drop_first=2))
    with pytest.raises(ActivationsError, match=refused):
        list(ActivationLoader(source, layers=1, batch_size=8, shuffle_tokens=16))
    with pytest.raises(ActivationsError, match=refused):
        open_activations(source).positions()
    with pytest.raises(ActivationsError, match=refused):
        ActivationLoader(str(victim), layers=1)  # the first shard's header is read when the loader starts


def test_positions_of_another_dtype_or_length_are_refused_naming_the_shard(copied):
    def short_positions(tensors, metadata):
        tensors[POSITIONS] = tensors[POSITIONS][:-1].astype(np.int64)

    rewrite(copied[1], short_positions)
    with pytest.raises(ActivationsError, match=f"shard {copied[1]}: positions is int64 .*; the format stores int32"):
        list(ActivationLoader(str(copied[0].parent.parent), layers=1, batch_size=8, shuffle=False))
