"""One JSON object per line, the way every line protocol here reads it (bottom floor: imports nothing of ours).

A worker reads its consumer's progress lines (`taskqueue.spawner.ProgressFile`) and a resident consumer's replies
(`taskqueue.process.parse_reply`); a resident consumer reads its worker's requests (`extract.resident.parse_request`).
The queue and the extraction may not import each other, so the one rule for a line lives here: at most `limit`
bytes, JSON, an object. Each caller raises its own error type, and checks its own fields.
"""

from __future__ import annotations

import json

__all__ = ["parse_object"]


def parse_object(line: bytes | str, limit: int, what: str, error: type[ValueError] = ValueError) -> dict:
    """The JSON object on `line`, or `error` naming `what` (e.g. "reply") and what is wrong with it."""
    if len(line) > limit:
        raise error(f"{what}: a line of {len(line)} bytes, over {limit}")
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not JSON ({exc}): {line[:200]!r}") from None
    if not isinstance(value, dict):
        raise error(f"{what} is not a JSON object: {line[:200]!r}")
    return value
