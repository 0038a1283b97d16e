"""Every error the loader raises about a shard names the shard: a missing layer, rows that do not match the token
count, broken document offsets, a shard gone from the bucket, and a checkpoint that names rows it cannot hold."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from activations.format import encode_safetensors, shard_name
from activations.io import ActivationsError
from activations.loader import ActivationLoader, LoaderConfigError
from tests.activations.test_loader_resume import HIDDEN, write_shards


def rewrite(path, change) -> None:
    """Re-encode a shard after `change(tensors, metadata)`."""
    from activations.format import decode_safetensors

    tensors, metadata = decode_safetensors(path.read_bytes())
    tensors = {name: np.array(array) for name, array in tensors.items()}
    change(tensors, metadata)
    path.write_bytes(encode_safetensors(tensors, metadata))


@pytest.fixture
def shards(tmp_path):
    write_shards(tmp_path, [12, 10, 14], [[5, 7], [10], [3, 0, 11]], layers=2)
    return sorted(tmp_path.glob("*.safetensors"))


def test_a_shard_that_lacks_a_requested_layer_is_named(shards):
    def drop_layer_1(tensors, metadata):  # the metadata still lists layer 1: the tensor itself is missing
        del tensors["layer_1"]

    rewrite(shards[1], drop_layer_1)
    loader = ActivationLoader(str(shards[0].parent), layers=1, batch_size=4, shuffle=False)
    with pytest.raises(ActivationsError, match=f"shard {shards[1]}: the shard has no tensor 'layer_1'"):
        list(loader)


def test_a_shard_that_did_not_extract_a_requested_layer_is_named(shards):
    def only_layer_0(tensors, metadata):
        del tensors["layer_1"]
        metadata["layers"] = json.dumps([0])

    rewrite(shards[2], only_layer_0)
    loader = ActivationLoader(str(shards[0].parent), layers=[0, 1], batch_size=4, shuffle_tokens=8, readahead=2)
    with pytest.raises(ActivationsError, match=f"shard {shards[2]}: layer_1 was not extracted"):
        list(loader)


def test_a_layer_with_fewer_rows_than_tokens_is_named(shards):
    def short_layer(tensors, metadata):
        tensors["layer_0"] = tensors["layer_0"][:-2]

    rewrite(shards[0], short_layer)
    with pytest.raises(ActivationsError, match=f"shard {shards[0]}: layer_0 has 10 rows, token_ids 12"):
        list(ActivationLoader(str(shards[0].parent), layers=0, batch_size=4, shuffle=False))


def test_offsets_that_do_not_cut_the_tokens_into_documents_are_named(shards):
    def bad_offsets(tensors, metadata):
        tensors["offsets"] = np.array([0, 9, 4], np.int64)

    rewrite(shards[1], bad_offsets)
    loader = ActivationLoader(str(shards[0].parent), layers=0, batch_size=4, shuffle=False, drop_first=1)
    with pytest.raises(ActivationsError, match=f"shard {shards[1]}: offsets .* do not cut its 10 tokens"):
        list(loader)


def test_a_shard_gone_from_the_bucket_is_named(gcs, gcs_bucket, gcs_client, shards):
    bucket = gcs_client.bucket(gcs_bucket)
    for path in shards:
        bucket.blob(f"out/{path.name}").upload_from_filename(str(path))
    loader = ActivationLoader(f"gs://{gcs_bucket}/out", layers=0, batch_size=4, shuffle=False, readahead=0,
                              client=gcs_client)  # fmt: skip
    bucket.blob(f"out/{shards[2].name}").delete()
    with pytest.raises(ActivationsError, match=f"gs://{gcs_bucket}/out/{shards[2].name}"):
        list(loader)


def test_a_checkpoint_naming_rows_outside_its_shard_is_refused_with_the_shard(shards):
    def make():
        return ActivationLoader(str(shards[0].parent), layers=0, batch_size=2, shuffle_tokens=6, rank=1, world_size=2)

    loader = make()
    next(loader)
    state = loader.state_dict()
    state["buffer_row"][0] = 0  # rank 1 holds the second half of each shard's rows
    with pytest.raises(LoaderConfigError, match=r"rows 0\.\.\d+ of shard .*safetensors, outside this rank's rows"):
        make().load_state_dict(state)
    state["buffer_shard"][0] = 7
    with pytest.raises(LoaderConfigError, match="names shard 7 of 3"):
        make().load_state_dict(state)


def test_shards_of_another_width_are_named(shards, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    rows = np.zeros((3, HIDDEN + 1), ml_dtypes.bfloat16)
    tensors = {"layer_0": rows, "token_ids": np.zeros(3, np.int32), "sample_ids": np.zeros(1, np.int64),
               "offsets": np.array([0, 3], np.int64)}  # fmt: skip
    odd = other / shard_name(900, 901)
    odd.write_bytes(encode_safetensors(tensors, {"layers": "[0]", "hidden_size": str(HIDDEN + 1)}))
    loader = ActivationLoader([str(p) for p in shards] + [str(odd)], layers=0, batch_size=4, shuffle=False)
    with pytest.raises(ActivationsError, match=f"shard {odd}: layer_0 is bfloat16 \\[3, {HIDDEN + 1}\\]"):
        list(loader)


def test_a_first_shard_without_its_listed_layer_is_named_when_the_loader_starts(shards):
    def drop_both(tensors, metadata):
        del tensors["layer_0"], tensors["layer_1"]

    rewrite(shards[0], drop_both)
    with pytest.raises(ActivationsError, match=f"shard {shards[0]}: the shard has no tensor 'layer_0'"):
        ActivationLoader(str(shards[0].parent), layers=0)
