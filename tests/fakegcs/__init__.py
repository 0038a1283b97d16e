"""An in-process GCS JSON-API server for tests: preconditions, fault injection, request counts.

`FakeGCS` embeds it in a test; `python -m tests.fakegcs` runs it standalone; `FakeGCSAdmin`
drives a standalone one from another process. See `server.py` for what it emulates.
"""

from tests.fakegcs.server import (
    DELETE,
    KINDS,
    LIST,
    READ,
    WRITE,
    FakeGCS,
    FakeGCSAdmin,
    FakeGCSError,
    Faults,
)

__all__ = ["DELETE", "KINDS", "LIST", "READ", "WRITE", "FakeGCS", "FakeGCSAdmin", "FakeGCSError", "Faults"]
