"""A model's files, from the Hub or a local checkpoint into a bucket (the mirror), and which files those are.

JAX-free (the README's base install runs `gcs-spawner mirror` and `up`'s mirror step): the checkpoint's loader,
which needs JAX, is extract/weights.py, and reads the mirror this writes. The Hub's client (huggingface_hub, the
`extract` extra) is imported only by what downloads from the Hub.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator

import objectstore
from extract.config import ModelConfig
from extract.errors import BadInput, TransientIOError

log = logging.getLogger(__name__)

#: The files a model directory needs; anything else in a hub repo (pytorch_model.bin, onnx, images) is skipped.
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",  # SentencePiece (Llama 2, Gemma), for tokenizers that have no tokenizer.json
    "*.safetensors",
    "model.safetensors.index.json",
)
INDEX_FILE = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILE_PATTERNS)


def is_hub_id(model: str) -> bool:
    """`org/name`, which is not an existing local directory: a Hugging Face hub id."""
    return (
        isinstance(model, str) and bool(_HUB_ID.match(model)) and not model.startswith(".")
        and not pathlib.Path(model).expanduser().is_dir()
    )  # fmt: skip


def need_hub_client() -> None:
    """Import the Hub's client, so that an install without it (the base install) fails here, before a download's
    progress starts: ModuleNotFoundError naming huggingface_hub, which gcs-spawner says in one line."""
    import huggingface_hub  # noqa: F401


def download_hub_snapshot(
    hub_id: str, *, revision: str | None = None, local_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """`snapshot_download` restricted to MODEL_FILE_PATTERNS; hub errors become BadInput or TransientIOError."""
    from huggingface_hub import snapshot_download

    with _hub_errors(hub_id, revision):
        path = snapshot_download(
            hub_id, revision=revision, allow_patterns=list(MODEL_FILE_PATTERNS), local_dir=local_dir
        )
    return pathlib.Path(path)


@contextlib.contextmanager
def _hub_errors(hub_id: str, revision: str | None) -> Iterator[None]:
    """A missing repo, revision or file is a BadInput; a network failure a TransientIOError."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except (RepositoryNotFoundError, RevisionNotFoundError, DisabledRepoError, HFValidationError,
            RemoteEntryNotFoundError) as exc:  # fmt: skip
        raise BadInput(f"model={hub_id!r} (revision={revision!r}) is not available on the hub: {exc}") from exc
    except OSError as exc:  # network failures, timeouts, offline mode without a cached copy
        raise TransientIOError(f"model={hub_id!r}: downloading from the hub failed: {exc}") from exc


def download_hub_config(hub_id: str, *, revision: str | None = None) -> pathlib.Path:
    """A hub model's config.json alone (`hf_hub_download`), so that it can be checked before the weights are
    downloaded; hub errors become BadInput or TransientIOError as in `download_hub_snapshot`."""
    from huggingface_hub import hf_hub_download

    with _hub_errors(hub_id, revision):
        return pathlib.Path(hf_hub_download(hub_id, "config.json", revision=revision))


def upload_model_dir(local_dir: str | os.PathLike, dest_url: str, on_file=None) -> list[str]:
    """Copy a model directory's files into `dest_url`; return the names written. `on_file(name, bytes)`, when
    given, is called after each file (a progress bar).

    config.json goes last: `fetch_from_store` treats a prefix without it as not mirrored, so a copy interrupted
    half-way is never loaded as a model.
    """
    local_dir = pathlib.Path(local_dir)
    files = sorted(p for p in local_dir.iterdir() if p.is_file() and is_model_file(p.name))
    names = [p.name for p in files]
    if "config.json" not in names:
        raise BadInput(f"{local_dir} has no config.json: it is not a model directory")
    if not any(name.endswith(".safetensors") for name in names):
        raise BadInput(f"{local_dir} has no *.safetensors files: only safetensors checkpoints can be mirrored")
    store = objectstore.open_store(dest_url)
    ordered = [p for p in files if p.name != "config.json"] + [local_dir / "config.json"]
    for path in ordered:
        # One file in memory at a time: the store interface writes whole objects.
        store.put_file(path.name, path)
        log.info("event=model_file_uploaded dest=%s name=%s bytes=%d", dest_url, path.name, path.stat().st_size)
        if on_file is not None:
            on_file(path.name, path.stat().st_size)
    return [p.name for p in ordered]


def mirror_hub_snapshot(hub_id: str, dest_url: str, *, revision: str | None = None, on_file=None) -> list[str]:
    """Copy a hub snapshot into an object store prefix, so that a fleet reads the bucket instead of the hub. Its
    config.json is read first: a model of a family the engine does not support is refused before any weight is
    downloaded."""
    ModelConfig.from_file(download_hub_config(hub_id, revision=revision))
    with tempfile.TemporaryDirectory(prefix="mirror-") as scratch:
        local = download_hub_snapshot(hub_id, revision=revision, local_dir=scratch)
        return upload_model_dir(local, dest_url, on_file=on_file)
