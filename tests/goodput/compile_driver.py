"""Compile engine programs in a fresh process with the compilation cache on, and say what the cache answered.

    python -m tests.goodput.compile_driver ROOT SPEC [SPEC ...]

SPEC is JSON: {"hidden": 64, "layers": 2, "seq_len": 32, "mesh": "data=1,model=1"}. Each spec builds a tiny
engine with random weights and compiles its forward at `seq_len`; stdout is one JSON object: the cache check's
figures (`checked`) and, per spec, "hit" or "miss" (entries written) from JAX's own events.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys


def main() -> None:
    import jax
    import numpy as np

    from extract import compilecache
    from extract.config import ModelConfig
    from extract.engine import Engine
    from extract.tiny import tiny_qwen_config

    root, specs = pathlib.Path(sys.argv[1]), [json.loads(raw) for raw in sys.argv[2:]]
    cache = compilecache.enable(root)
    answers = []
    for spec in specs:
        mesh = dict(part.split("=") for part in spec["mesh"].split(","))
        devices = jax.devices()[: int(mesh["data"]) * int(mesh["model"])]
        config = ModelConfig.from_dict(tiny_qwen_config("qwen2", spec["hidden"], spec["layers"], 4, 2, 384, False,
                                                        2 * spec["hidden"]))  # fmt: skip
        engine = Engine.with_random_weights(config, [spec["layers"]], batch_size=2, max_seq_len=spec["seq_len"],
                                            compute_dtype="float32", out_dtype="float32", mesh=spec["mesh"],
                                            devices=devices)  # fmt: skip
        engine.compile_hook = lambda seq_len, packed, stage: cache.compiling() if stage == "compile" else contextlib.nullcontext()
        before = compilecache.counts()
        jax.block_until_ready(list(engine.forward(np.zeros((2, spec["seq_len"]), np.int32)).values()))
        after = compilecache.counts()
        answers.append("hit" if after["hits"] > before["hits"] else "miss" if after["misses"] > before["misses"] else "none")
    print(json.dumps({"checked": cache.checked, "dir": str(cache.directory), "answers": answers}))


if __name__ == "__main__":
    main()
