"""The real Google Cloud CLI (`gcloud`, installed on every machine here) pointed at the test servers.

A private configuration directory (CLOUDSDK_CONFIG) with credentials turned off and each API's
endpoint overridden, as gcloud documents for other endpoints
(https://cloud.google.com/sdk/gcloud/reference/topic/configurations, `api_endpoint_overrides/...`;
`auth/disable_credentials`). Nothing of the user's own gcloud configuration is read or changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

PROJECT = "fake-project"


def require_gcloud() -> str:
    """gcloud's path, or skip the test saying why."""
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        pytest.skip("the Google Cloud CLI (gcloud) is not on PATH; these tests run the real CLI against the fakes")
    return gcloud


def write_config(directory: Path, storage: str | None = None, compute: str | None = None, tpu: str | None = None,
                 project: str = PROJECT) -> Path:
    """A gcloud configuration directory whose `default` configuration sends storage, compute and tpu
    requests to the given base URLs (http://127.0.0.1:PORT), with no credentials."""
    overrides = {"storage": f"{storage}/storage/v1/" if storage else None,
                 "compute": f"{compute}/compute/v1/" if compute else None,
                 "tpu": f"{tpu}/" if tpu else None}
    lines = ["[core]", f"project = {project}", "disable_usage_reporting = True", "disable_prompts = True",
             "[auth]", "disable_credentials = True",
             "[component_manager]", "disable_update_check = True",
             "[api_endpoint_overrides]", *(f"{api} = {url}" for api, url in overrides.items() if url)]
    (directory / "configurations").mkdir(parents=True, exist_ok=True)
    (directory / "configurations" / "config_default").write_text("\n".join(lines) + "\n")
    (directory / "active_config").write_text("default")
    return directory


class Gcloud:
    """Runs the real gcloud with a private configuration (see write_config)."""

    def __init__(self, config: Path):
        self.path = require_gcloud()
        self.config = config
        self.env = {**os.environ, "CLOUDSDK_CONFIG": str(config)}

    def __call__(self, *args: str, stdin: bytes | None = None, check: bool = True, timeout: float = 120,
                 env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run([self.path, *args], input=stdin, capture_output=True, timeout=timeout,
                                env={**self.env, **(env or {})})
        if check and result.returncode != 0:
            raise AssertionError(f"gcloud {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stderr.decode(errors='replace')[-3000:]}")
        return result
