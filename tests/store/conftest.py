import pytest

from objectstore.gcs import GCSStore, RetryPolicy
from objectstore.local import LocalStore


@pytest.fixture(params=["local", "gcs"])
def store(request, tmp_path):
    """The same contract, on a local directory and on GCS through the real client and the fake server."""
    if request.param == "local":
        return LocalStore(tmp_path / "bucket")
    client = request.getfixturevalue("gcs_client")
    bucket = request.getfixturevalue("gcs_bucket")
    return GCSStore(bucket, "queue", client=client, policy=RetryPolicy(initial_s=0.01, cap_s=0.05, deadline_s=5))


@pytest.fixture
def gcs_store(gcs_client, gcs_bucket):
    return GCSStore(gcs_bucket, "queue", client=gcs_client, policy=RetryPolicy(initial_s=0.01, cap_s=0.05, deadline_s=5))
