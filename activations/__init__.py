"""Activation shards for training: the one shard-format definition, the sample reader and the streaming loader.

Extraction (`extract/`) writes shards through `activations.format`; readers (`activations.reader`, the loader in
`activations.loader`, the SAELens export) read them through it. This package needs numpy, ml_dtypes and, for gs://,
google-cloud-storage (`pip install .[train]`); it never imports JAX or the task queue.
"""

from activations.io import ActivationsError
from activations.reader import Activations, ShardRef, open_activations, resolve_shards

__all__ = ["Activations", "ActivationsError", "ShardRef", "open_activations", "resolve_shards"]
