"""Error types shared by the extraction, and the exit codes they map to (the consumer contract).

Exit codes: 0 done; 65 bad input (dead-lettered, never retried); 75 transient I/O (retried); 70 any other failure
(retried). consume.py, the slice hosts and the planning tools all map exceptions through `exit_code_for`.
"""

from __future__ import annotations

import logging

from exitcodes import EX_DATAERR, EX_FAILED, EX_OK, EX_SOFTWARE, EX_TEMPFAIL

__all__ = ["EX_DATAERR", "EX_OK", "EX_SOFTWARE", "EX_TEMPFAIL", "BadInput", "ExtractError", "TransientIOError",
           "exit_code_for", "exit_for_failure", "is_transient"]


class ExtractError(Exception):
    """Base of extraction failures."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


class BadInput(ExtractError):
    """Input that retrying cannot fix (exit 65): unknown model_type, missing weights,
    layer out of range, missing/non-string text field, empty slice, unreadable data file, bad job field."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


class TransientIOError(ExtractError):
    """I/O that may succeed on retry (exit 75 or 1)."""


def is_transient(exc: BaseException) -> bool:
    """Failures a later attempt may not meet: our own transient type, the store's, and network errors."""
    from objectstore import StoreUnavailable

    if isinstance(exc, (TransientIOError, StoreUnavailable, ConnectionError, TimeoutError)):
        return True
    try:
        from objectstore.gcs import is_transient as gcs_transient
    except ImportError:  # google-cloud-storage absent: only local stores are in use
        return False
    return gcs_transient(exc)


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, BadInput):
        return EX_DATAERR
    if is_transient(exc):
        return EX_TEMPFAIL
    return EX_SOFTWARE


def exit_for_failure(exc: Exception, log: logging.Logger, event: str) -> int:
    """For a command-line tool's last `except`: bad input and transient failures become one log line and their exit
    code (65, 75); anything else is a bug and is re-raised, so its traceback shows."""
    code = exit_code_for(exc)
    if code == EX_SOFTWARE:
        raise exc
    log.error("event=%s exit=%d error=%s", event, code, exc)
    return code
