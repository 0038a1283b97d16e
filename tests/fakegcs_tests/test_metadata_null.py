"""The test server refuses `"metadata": null` on inserts the way stricter JSON API implementations do."""

from __future__ import annotations

import pytest
from google.api_core import exceptions


def test_insert_with_null_metadata_is_refused_with_500(gcs_client, gcs_bucket):
    blob = gcs_client.bucket(gcs_bucket).blob("nulled")
    blob.metadata = None  # what `GCSStore.put` used to do: the resource then says "metadata": null
    with pytest.raises(exceptions.InternalServerError, match="metadata"):
        blob.upload_from_string(b"x", retry=None)
    assert not gcs_client.bucket(gcs_bucket).blob("nulled").exists()


def test_insert_without_metadata_key_is_accepted(gcs_client, gcs_bucket):
    blob = gcs_client.bucket(gcs_bucket).blob("plain")
    blob.upload_from_string(b"x", retry=None)
    assert gcs_client.bucket(gcs_bucket).blob("plain").download_as_bytes() == b"x"
