"""Error types shared by the extraction: the consumer maps them to exit codes."""


class ExtractError(Exception):
    """Base of extraction failures."""


class BadInput(ExtractError):
    """Input that retrying cannot fix (exit 65): unknown model_type, missing weights,
    layer out of range, missing/non-string text field, empty slice, unreadable data file, bad job field."""


class TransientIOError(ExtractError):
    """I/O that may succeed on retry (exit 75 or 1)."""
