import pytest

from objectstore.gcs import GCSStore, RetryPolicy
from objectstore.local import LocalStore
from tests.simworld.scheduler import Scheduler
from tests.simworld.store import SimStore


@pytest.fixture(params=["local", "gcs", "sim"])
def store(request, tmp_path):
    """The same contract on a local directory, on GCS through the real client and the fake server, and
    on the simulation's store (tests/simworld), outside any actor: the store the simulated workers use
    must keep the promises the real ones do."""
    if request.param == "local":
        return LocalStore(tmp_path / "bucket")
    if request.param == "sim":
        return SimStore(Scheduler())
    client = request.getfixturevalue("gcs_client")
    bucket = request.getfixturevalue("gcs_bucket")
    return GCSStore(bucket, "queue", client=client, policy=RetryPolicy(initial_s=0.01, cap_s=0.05, deadline_s=5))


@pytest.fixture
def gcs_store(gcs_client, gcs_bucket):
    return GCSStore(gcs_bucket, "queue", client=gcs_client, policy=RetryPolicy(initial_s=0.01, cap_s=0.05, deadline_s=5))
