"""The storage sampling rule (activations/sampling.py) over the whole space, and the job fields that set it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from activations.sampling import TokenSampling
from extract.errors import BadInput
from extract.job import Job
from tests.extract_pipeline.test_sampling_run import reference_kept

JOB = {"model": "m", "data_files": ["x.parquet"], "layers": [1], "max_seq_len": 8, "batch_size": 1, "shard_size": 1}

fractions = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)
seeds = st.integers(min_value=0, max_value=2**64 - 1)
sample_ids = st.integers(min_value=0, max_value=2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(fraction=fractions, drop_first=st.integers(0, 40), seed=seeds, sample_id=sample_ids, n=st.integers(0, 300))
def test_kept_positions_are_the_rule_written_in_plain_integers(fraction, drop_first, seed, sample_id, n):
    sampling = TokenSampling(fraction, drop_first, seed)
    assert sampling.kept(sample_id, n).tolist() == reference_kept(seed, sample_id, n, fraction, drop_first)


@settings(max_examples=200, deadline=None)
@given(fraction=fractions, seed=seeds, sample_id=sample_ids, n=st.integers(0, 200), longer=st.integers(0, 200))
def test_a_position_is_kept_whatever_the_document_length(fraction, seed, sample_id, n, longer):
    """Truncation (max_seq_len) or a longer row never changes the choice at a given position."""
    sampling = TokenSampling(fraction, 1, seed)
    short, long = sampling.kept(sample_id, n), sampling.kept(sample_id, n + longer)
    assert np.array_equal(short, long[long < n])


def test_the_kept_share_is_the_fraction_and_independent_of_neighbours():
    sampling = TokenSampling(0.1, 0, 3)
    keep = np.zeros((2000, 500), bool)
    for sample_id in range(2000):
        keep[sample_id, sampling.kept(sample_id, 500)] = True
    assert keep.mean() == pytest.approx(0.1, abs=0.002)  # 1e6 draws: 3 standard deviations is 0.0009
    # Neighbouring positions and neighbouring documents are uncorrelated.
    assert abs(np.corrcoef(keep[:, :-1].ravel(), keep[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(keep[:-1].ravel(), keep[1:].ravel())[0, 1]) < 0.01
    # Another seed is another choice.
    other = TokenSampling(0.1, 0, 4)
    assert not np.array_equal(sampling.kept(7, 500), other.kept(7, 500))


def test_every_position_is_kept_without_sampling_and_none_below_drop_first():
    assert not TokenSampling().active
    assert TokenSampling().kept(5, 7).tolist() == list(range(7))
    assert TokenSampling(1.0, 3).kept(5, 7).tolist() == [3, 4, 5, 6]
    assert TokenSampling(0.5, 10).kept(5, 7).tolist() == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token_sample": 0}, "token_sample: must be a fraction in (0, 1]"),
        ({"token_sample": 1.5}, "token_sample: must be a fraction in (0, 1]"),
        ({"token_sample": "0.1"}, "token_sample: must be a fraction in (0, 1]"),
        ({"token_sample": True}, "token_sample: must be a fraction in (0, 1]"),
        ({"drop_first": -1}, "drop_first: must be a non-negative integer"),
        ({"drop_first": 1.5}, "drop_first: must be a non-negative integer"),
        ({"sample_seed": 2**64}, "sample_seed: must be an integer from 0 to 2**64 - 1"),
        ({"sample_seed": -1}, "sample_seed: must be an integer from 0 to 2**64 - 1"),
    ],
)
def test_bad_sampling_fields_name_the_field(fields, message):
    with pytest.raises(BadInput) as error:
        Job.from_dict({**JOB, **fields})
    assert str(error.value).startswith(message)


def test_job_sampling_fields_become_the_rule():
    job = Job.from_dict({**JOB, "token_sample": 1, "drop_first": 0})
    assert not job.sampling.active
    job = Job.from_dict({**JOB, "token_sample": 0.25, "drop_first": 2, "sample_seed": 9})
    assert job.sampling == TokenSampling(0.25, 2, 9) and job.sampling.active
    assert TokenSampling.from_metadata({"sampling": job.sampling.to_json()}) == job.sampling
