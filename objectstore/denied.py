"""A store that refuses a caller (HTTP 403) said in one line: the permission, the object and the principal.

Cloud Storage answers a caller that lacks a permission with 403 and a message naming both, e.g.
"sa@p.iam.gserviceaccount.com does not have storage.objects.list access to the Google Cloud Storage
bucket." (https://cloud.google.com/storage/docs/troubleshooting, "403: Forbidden"). The client
library raises it as `google.api_core.exceptions.Forbidden`, whose text also holds the request's URL.
No retry helps (objectstore/gcs.py re-raises it as it is), so a worker says this line, records it and
exits 65 instead of dying with a traceback and being restarted into the same refusal.

Read by duck typing (`code == 403`), so that the queue need not import the Google client.
"""

from __future__ import annotations

import re
import urllib.parse

_DENIED = re.compile(r"(?P<principal>[^\s:\"']+(?: caller)?) does not have (?P<permission>[\w.]+) access")
_JSON_API = re.compile(r"/storage/v1/b/(?P<bucket>[^/?\s]+)(?:/o(?:/(?P<object>[^?\s]+))?)?")


def permission_denied(exc: BaseException, url: str) -> str | None:
    """One line for a 403 from the store, naming the permission, the object (or bucket) and the
    principal, and what to do; None for any other error. `url` is the queue's, said when the error
    does not name its object."""
    if getattr(exc, "code", None) != 403:
        return None
    text = str(exc)
    found = _DENIED.search(text)
    principal = found["principal"] if found else "this machine's service account"
    permission = found["permission"] if found else "a storage permission"
    target = url
    request = _JSON_API.search(text)
    if request:
        name = request["object"]
        target = f"gs://{request['bucket']}/{urllib.parse.unquote(name)}" if name else f"gs://{request['bucket']}"
    return (f"permission denied: {principal} lacks {permission} on {target}: grant it a role with that permission "
            f"on the queue's bucket (roles/storage.objectUser; docs/CLOUD.md, IAM and scopes)")  # fmt: skip
