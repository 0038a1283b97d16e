"""Where a machine keeps what it may reuse across tasks: `$XDG_CACHE_HOME/gcs-spawner` (default
`~/.cache/gcs-spawner`, the XDG Base Directory default), holding `jax/` (compiled programs, extract/compilecache.py)
and `weights/` (checkpoint files, extract/weightcache.py).

Everything under it is a cache: deleting it costs time, never a result, and each reader checks what it reads
before trusting it.
"""

from __future__ import annotations

import os
import pathlib

APP = "gcs-spawner"


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / APP


def setting(env: str, default: pathlib.Path) -> pathlib.Path | None:
    """`$env` as a directory, `default` when unset, None when it says `off`."""
    raw = os.environ.get(env, "").strip()
    if raw.lower() == "off":
        return None
    return pathlib.Path(raw).expanduser() if raw else default
