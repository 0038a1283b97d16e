"""What the Compute Engine and Cloud TPU calls share: where the clients connect, how a request
is shown for `--dry-run`, and how a batch of requests is sent and waited for.

Requests are the client libraries' own request messages (`compute_v1.InsertInstanceTemplateRequest`,
`tpu_v2.CreateNodeRequest`, ...), built first and sent second, so a dry run prints exactly what a
real run would send.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence

import proto
import requests
from google.api_core import exceptions as api_exceptions
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials

from exitcodes import EX_FAILED

log = logging.getLogger(__name__)

#: What a call through the client libraries can fail with: the API's answer, the transport (the
#: REST transport lets requests' errors through), missing credentials, an operation outlasting its wait.
API_ERRORS = (
    api_exceptions.GoogleAPIError,
    requests.RequestException,
    auth_exceptions.GoogleAuthError,
    concurrent.futures.TimeoutError,
)


class LaunchError(Exception):
    """A Compute or TPU request failed; the message names each request and the API's answer."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


#: What to do when Application Default Credentials are missing or expired (google.auth.default's search:
#: https://cloud.google.com/docs/authentication/application-default-credentials).
LOGIN_HINT = ("run 'gcloud auth application-default login' (or set GOOGLE_APPLICATION_CREDENTIALS to a service "
              "account key file)")


def credentials_problem(err: BaseException) -> str | None:
    """One line saying how to log in, when `err` (or what caused it) is a missing or refused credential; else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError)):
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return f"no usable Google Cloud credentials ({_first_sentence(first)}): {LOGIN_HINT}"
        err = err.__cause__ or err.__context__
    return None


def _first_sentence(text: str, limit: int = 160) -> str:
    """The first sentence of `text`, cut at a word (never mid-word) with an ellipsis when it is longer than `limit`."""
    sentence = text.split(". ", 1)[0].rstrip(".")
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def client_args(endpoint_env: str) -> dict:
    """Constructor arguments for a Google API client, honouring an endpoint override.

    `endpoint_env` names a variable (FLEET_COMPUTE_ENDPOINT, FLEET_TPU_ENDPOINT) that, when set,
    redirects the client, for private endpoints and for tests. A plain `http://` endpoint can only
    be a local test server, so it gets anonymous credentials; anything else uses Application
    Default Credentials as usual.
    """
    endpoint = os.environ.get(endpoint_env)
    if not endpoint:
        return {}
    args: dict = {"client_options": ClientOptions(api_endpoint=endpoint), "transport": "rest"}
    if endpoint.startswith("http://"):
        args["credentials"] = AnonymousCredentials()
    return args


def describe(request: proto.Message) -> dict:
    """The request message as JSON (REST field names): its path parameters and its body."""
    fields = json.loads(type(request).to_json(request, always_print_fields_with_no_presence=False))
    return {"request": type(request).__name__, "fields": fields}


#: Fields of a request's resource body worth a word in its one-line form (the rest is in `describe`).
_LINE_FIELDS = ("name", "target_size", "accelerator_type", "instance_template")


def request_line(request: proto.Message) -> str:
    """The request on one line: its type, its path parameters, and the resource's name and size, e.g.
    `InsertInstanceGroupManagerRequest project=p zone=z instance_group_manager_resource.name=w target_size=8`."""
    body = type(request).to_dict(request)
    words = [type(request).__name__]
    for key, value in body.items():
        if isinstance(value, (str, int)) and not isinstance(value, bool) and value not in ("", 0):
            words.append(f"{key}={value}")
        elif isinstance(value, bool) and value:
            words.append(f"{key}=true")
        elif isinstance(value, dict):
            words += [f"{key}.{field}={value[field]}" for field in _LINE_FIELDS if value.get(field)]
    return " ".join(words)


def print_dry_run(batch: Sequence[proto.Message], bodies: bool = False) -> None:
    """One line per request (`request_line`); with `bodies`, every request whole as JSON (`describe`)."""
    if bodies:
        print(json.dumps([describe(r) for r in batch], indent=2, sort_keys=True))
        return
    for request in batch:
        print(f"would send {request_line(request)}")


def target_of(request: proto.Message) -> str:
    """A short name for log lines and error messages: the resource the request acts on."""
    body = type(request).to_dict(request)
    for key in ("name", "node_id", "queued_resource_id", "instance_group_manager", "instance_template", "instance"):
        if body.get(key):
            return str(body[key])
    for resource in ("instance_template_resource", "instance_group_manager_resource"):
        if body.get(resource, {}).get("name"):
            return str(body[resource]["name"])
    return type(request).__name__


def run_all(send: Callable[[proto.Message], None], batch: Sequence[proto.Message], parallel: int = 8) -> None:
    """Send every request (in parallel), wait for each, and raise one LaunchError naming all failures."""
    failures: list[str] = []

    def one(request: proto.Message) -> None:
        kind, target = type(request).__name__, target_of(request)
        log.info("event=request_sent request=%s target=%s", kind, target)
        send(request)
        log.info("event=request_done request=%s target=%s", kind, target)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(batch)))) as pool:
        futures = {pool.submit(one, r): r for r in batch}
        for future in concurrent.futures.as_completed(futures):
            request = futures[future]
            try:
                future.result()
            except API_ERRORS as err:
                line = f"{type(request).__name__} {target_of(request)}: {err}"
                log.error("event=request_failed request=%s target=%s error=%s", type(request).__name__, target_of(request), err)
                failures.append(line)
    if failures:
        raise LaunchError(
            f"{len(failures)} of {len(batch)} requests failed (fix the cause and re-run; gcs-spawner down "
            "deletes what a run made):\n  " + "\n  ".join(sorted(failures))
        )


def _gcloud_config(prop: str) -> str | None:
    """A `gcloud config` property, if gcloud is installed and has it set."""
    gcloud = shutil.which("gcloud")
    if not gcloud:
        return None
    try:
        result = subprocess.run(
            [gcloud, "config", "get-value", prop], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("event=gcloud_config_unreadable property=%s error=%s", prop, err)
        return None
    value = result.stdout.strip()
    return value if result.returncode == 0 and value and value != "(unset)" else None


def default_project() -> str | None:
    """--project's default: CLOUDSDK_CORE_PROJECT, GOOGLE_CLOUD_PROJECT, then `gcloud config`."""
    return os.environ.get("CLOUDSDK_CORE_PROJECT") or os.environ.get("GOOGLE_CLOUD_PROJECT") or _gcloud_config("project")


def default_zone() -> str | None:
    """--zone's default: CLOUDSDK_COMPUTE_ZONE, then `gcloud config get-value compute/zone`."""
    return os.environ.get("CLOUDSDK_COMPUTE_ZONE") or _gcloud_config("compute/zone")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
