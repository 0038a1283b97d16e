"""Who may do what: Cloud Resource Manager's `projects.testIamPermissions` and `projects.getIamPolicy`.

A machine asks, before it claims any work, whether its own credentials hold the permissions it
will need to delete itself (fleet.selfdelete); the launch tools read the project's IAM policy to
check the machines' service account up front (fleet.preflight).

REST, through google-auth's AuthorizedSession: the calls are two POSTs and not worth a client library.
- https://cloud.google.com/resource-manager/reference/rest/v1/projects/testIamPermissions
  (answers the subset of the asked permissions that the caller holds on the project)
- https://cloud.google.com/resource-manager/reference/rest/v1/projects/getIamPolicy
The token's access scopes must allow the call: `cloud-platform` does (templates/*.yaml).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import google.auth
import requests
from google.auth.transport.requests import AuthorizedSession

ENDPOINT_ENV = "FLEET_CRM_ENDPOINT"
DEFAULT_ENDPOINT = "https://cloudresourcemanager.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"


class IamError(Exception):
    """An IAM call failed or answered something it cannot have meant; the message names the call,
    the project and the answer. `status` is the HTTP status, None when no answer came."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ResourceManager:
    """projects.testIamPermissions and projects.getIamPolicy on one endpoint.

    FLEET_CRM_ENDPOINT redirects it (tests, private endpoints); a plain `http://` endpoint is a
    local test server and gets no credentials."""

    def __init__(self, endpoint: str | None = None, session: requests.Session | None = None, timeout_s: float = 30.0):
        self.endpoint = (endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")
        self.timeout_s = timeout_s
        if session is None:
            if self.endpoint.startswith("http://"):
                session = requests.Session()
            else:
                credentials, _ = google.auth.default(scopes=[SCOPE])
                session = AuthorizedSession(credentials)
        self.session = session

    def _post(self, project: str, verb: str, body: dict) -> dict:
        url = f"{self.endpoint}/v1/projects/{project}:{verb}"
        try:
            resp = self.session.post(url, json=body, timeout=self.timeout_s)
        except requests.RequestException as err:
            raise IamError(f"projects.{verb} on project {project!r} could not be sent: {err}") from None
        if resp.status_code != 200:
            raise IamError(f"projects.{verb} on project {project!r} answered {resp.status_code}: {resp.text[:300]}",
                           resp.status_code)
        try:
            answer = resp.json()
        except ValueError:
            raise IamError(f"projects.{verb} on project {project!r} answered 200 with no JSON: {resp.text[:300]}", 200) from None
        if not isinstance(answer, dict):
            raise IamError(f"projects.{verb} on project {project!r} answered 200 with {resp.text[:300]}", 200)
        return answer

    def held(self, project: str, permissions: Sequence[str]) -> set[str]:
        """The permissions in `permissions` that the caller holds on `project`.

        The answer is the subset of the asked permissions that the caller holds, the field left out
        when it holds none (testIamPermissions, above). An answer outside that shape (a permission not
        asked, a value not a list of strings) raises IamError: it does not say what is held."""
        answer = self._post(project, "testIamPermissions", {"permissions": list(permissions)})
        granted = answer.get("permissions", [])
        if not isinstance(granted, list) or not all(isinstance(p, str) and p in permissions for p in granted):
            raise IamError(f"projects.testIamPermissions on project {project!r} asked for {', '.join(permissions)} "
                           f"and answered {str(answer)[:300]}", 200)
        return set(granted)

    def policy(self, project: str) -> dict:
        return self._post(project, "getIamPolicy", {"options": {"requestedPolicyVersion": 3}})


def roles_of(policy: dict, member: str) -> set[str]:
    """Roles bound to `member` (e.g. `serviceAccount:sa@p.iam.gserviceaccount.com`) without a condition."""
    return {b["role"] for b in policy.get("bindings", []) if member in b.get("members", []) and not b.get("condition")}
