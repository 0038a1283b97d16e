"""Fixtures for simulated slices: two JAX processes on this machine's CPUs, 2 devices each.

The tiny checkpoints, parquet corpus and compilation cache come from the extraction pipeline's fixtures.
"""

from __future__ import annotations

import socket

import pytest

from tests.extract_pipeline.conftest import consume_env, corpus, jax_cache, run_consume, tiny_models  # noqa: F401

#: Each simulated host sees 2 CPU devices, so the slice has 4, like the single-process reference.
HOST_XLA_FLAGS = "--xla_force_host_platform_device_count=2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def coordinator() -> str:
    return f"127.0.0.1:{free_port()}"
