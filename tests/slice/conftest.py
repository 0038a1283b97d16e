"""Fixtures for simulated slices: two JAX processes on this machine's CPUs, 2 devices each.

The tiny checkpoints, parquet corpus and compilation cache come from the extraction pipeline's fixtures.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from activations.reader import open_activations
from tests.extract_pipeline.conftest import (  # noqa: F401 (fixtures)
    ConsumeRun,
    base_job,
    consume_env,
    corpus,
    jax_cache,
    run_consume,
    tiny_models,
)

#: Each simulated host sees 2 CPU devices, so the slice has 4, like the single-process reference.
HOST_XLA_FLAGS = "--xla_force_host_platform_device_count=2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def coordinator() -> str:
    return f"127.0.0.1:{free_port()}"


#: All 220 rows of the corpus in one task, across two file boundaries.
ALL_ROWS = [(0, 0, 90), (1, 0, 50), (2, 0, 80)]


def slice_job(tiny_models, corpus, **overrides) -> dict:
    """fp32, so that runs laid out differently agree to float rounding."""
    return base_job(tiny_models["qwen2"], corpus, dtype="fp32", compute_dtype="fp32", **overrides)


def samples_by_id(output: str) -> dict[int, tuple[np.ndarray, dict[int, np.ndarray]]]:
    """Every stored sample by id; a sample stored twice fails."""
    out: dict = {}
    for sample in open_activations(output).samples():
        assert sample.sample_id not in out, f"sample {sample.sample_id} stored twice"
        out[sample.sample_id] = (sample.token_ids, {k: np.asarray(v, np.float32) for k, v in sample.layers.items()})
    return out


def assert_same_samples(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for sample_id, (tokens, layers) in expected.items():
        np.testing.assert_array_equal(got[sample_id][0], tokens)
        for layer, values in layers.items():
            np.testing.assert_allclose(got[sample_id][1][layer], values, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_models, corpus, run_consume) -> dict:
    """The whole corpus as one task, run by one process on 4 devices: what every slice run must reproduce."""
    workdir = tmp_path_factory.mktemp("slice-reference")
    spec = ConsumeRun(
        workdir=workdir,
        job=slice_job(tiny_models, corpus, mesh="model=4"),
        task={"id": "t000000", "files": corpus.slice_files(ALL_ROWS)},
        output=str(workdir / "out"),
    )
    assert run_consume(spec).returncode == 0, spec.stderr_file.read_text()
    return samples_by_id(spec.output)
