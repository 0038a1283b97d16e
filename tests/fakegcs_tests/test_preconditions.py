"""Generation preconditions answer with GCS's own status codes: 412, 404 and 304."""

from __future__ import annotations

import pytest
from google.api_core import exceptions


@pytest.fixture
def bucket(gcs_client, gcs_bucket):
    return gcs_client.bucket(gcs_bucket)


def test_create_if_absent_succeeds_once_then_fails_412(bucket):
    first = bucket.blob("lease")
    first.upload_from_string(b"mine", if_generation_match=0)
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("lease").upload_from_string(b"theirs", if_generation_match=0, retry=None)
    assert bucket.blob("lease").download_as_bytes() == b"mine"


def test_write_if_generation_matches_replaces_only_the_observed_generation(bucket):
    blob = bucket.blob("lease")
    blob.upload_from_string(b"v1")
    observed = blob.generation
    replacement = bucket.blob("lease")
    replacement.upload_from_string(b"v2", if_generation_match=observed)
    assert replacement.generation > observed and replacement.metageneration == 1
    with pytest.raises(exceptions.PreconditionFailed):  # the stale view loses
        bucket.blob("lease").upload_from_string(b"v3", if_generation_match=observed, retry=None)
    assert bucket.blob("lease").download_as_bytes() == b"v2"


def test_write_if_generation_matches_on_missing_object_is_412(bucket):
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("never-written").upload_from_string(b"x", if_generation_match=12345, retry=None)
    assert not bucket.blob("never-written").exists()


def test_write_if_generation_not_match_refuses_that_generation(bucket):
    blob = bucket.blob("obj")
    blob.upload_from_string(b"v1")
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("obj").upload_from_string(b"v2", if_generation_not_match=blob.generation, retry=None)
    bucket.blob("obj").upload_from_string(b"v2", if_generation_not_match=blob.generation + 1)
    assert bucket.blob("obj").download_as_bytes() == b"v2"


def test_metageneration_match_guards_patch_and_write(bucket):
    blob = bucket.blob("meta")
    blob.upload_from_string(b"x")
    blob.metadata = {"k": "1"}
    blob.patch(if_metageneration_match=1)
    assert blob.metageneration == 2
    stale = bucket.blob("meta")
    stale.metadata = {"k": "stale"}
    with pytest.raises(exceptions.PreconditionFailed):
        stale.patch(if_metageneration_match=1, retry=None)
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("meta").upload_from_string(b"y", if_metageneration_match=1, retry=None)
    assert bucket.get_blob("meta").metadata == {"k": "1"}


def test_patch_and_delete_of_missing_object_are_404(bucket):
    ghost = bucket.blob("ghost")
    ghost.metadata = {"k": "v"}
    with pytest.raises(exceptions.NotFound):
        ghost.patch(retry=None)
    with pytest.raises(exceptions.NotFound):
        ghost.delete(if_generation_match=1, retry=None)


def test_delete_if_generation_matches(bucket):
    blob = bucket.blob("victim")
    blob.upload_from_string(b"x")
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("victim").delete(if_generation_match=blob.generation + 1, retry=None)
    bucket.blob("victim").delete(if_generation_match=blob.generation)
    assert not bucket.blob("victim").exists()


def test_reads_answer_404_412_and_304(bucket):
    with pytest.raises(exceptions.NotFound):
        bucket.blob("missing").download_as_bytes(retry=None)
    with pytest.raises(exceptions.NotFound):
        bucket.blob("missing").reload(retry=None)
    blob = bucket.blob("read")
    blob.upload_from_string(b"content")
    assert bucket.blob("read").download_as_bytes(if_generation_match=blob.generation) == b"content"
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("read").download_as_bytes(if_generation_match=blob.generation + 1, retry=None)
    with pytest.raises(exceptions.NotModified):
        bucket.blob("read").download_as_bytes(if_generation_not_match=blob.generation, retry=None)
    with pytest.raises(exceptions.NotModified):
        bucket.blob("read").reload(if_metageneration_not_match=1, retry=None)
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("read").reload(if_metageneration_match=2, retry=None)


def test_read_of_a_replaced_generation_is_404(bucket):
    old = bucket.blob("versioned")
    old.upload_from_string(b"old")
    bucket.blob("versioned").upload_from_string(b"new")
    with pytest.raises(exceptions.NotFound):
        bucket.blob("versioned", generation=old.generation).download_as_bytes(retry=None)
