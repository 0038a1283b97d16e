"""Reading activation shards back: `open_activations(...)` over a queue, a done marker, a prefix of shards, or one
shard.

The reader lives in `activations.reader` with the one definition of the shard format (`activations.format`), so a
trainer's machine imports it without JAX and without the queue; this module keeps the extraction's old import path.
"""

from activations.io import ActivationsError
from activations.reader import (
    Activations,
    SampleActivations,
    Shard,
    ShardRef,
    load_shard,
    open_activations,
    resolve_shards,
)

__all__ = [
    "Activations",
    "ActivationsError",
    "SampleActivations",
    "Shard",
    "ShardRef",
    "load_shard",
    "open_activations",
    "resolve_shards",
]
