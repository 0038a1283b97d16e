"""How far a float32 matmul on the CPU is from float64, by kernel, side by side on the same inputs: XLA's default
(YNNPACK's dot), XLA without YNNPACK (the option a float32 engine compiles with, `Engine.compiler_options`: its own
Eigen dot), torch's matmul (transformers' float32 reference) and numpy's. Each figure is max |x - float64| / max
|float64| over the product; the last columns are the XLA kernels' errors over torch's. The rows are the products
of a layer at Qwen3-30B-A3B's width (o_proj's 4,096 inputs to 2,048) at several row counts (batch x tokens).

    PYTHONPATH=. python bench/cpu_matmul.py
"""

from __future__ import annotations

import jax
import numpy as np
import torch

INPUTS, OUTPUTS = 4096, 2048
ROWS = (8, 32, 48, 64, 128, 256)
WITHOUT_YNNPACK = {"xla_cpu_experimental_ynn_fusion_type": ""}


def main() -> None:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((INPUTS, OUTPUTS)) * 0.02).astype(np.float32)
    print("| rows | XLA default | XLA without YNNPACK | torch | numpy | default / torch | without / torch |")
    print("|---|---|---|---|---|---|---|")
    for rows in ROWS:
        x = rng.standard_normal((rows, INPUTS)).astype(np.float32)
        exact = x.astype(np.float64) @ weights.astype(np.float64)
        with jax.default_matmul_precision("highest"):  # as the engine traces a float32 job
            lowered = jax.jit(lambda a, b: a @ b).lower(x, weights)
        default = lowered.compile()(x, weights)
        eigen = lowered.compile(compiler_options=WITHOUT_YNNPACK)(x, weights)
        reference = (torch.from_numpy(x) @ torch.from_numpy(weights)).numpy()

        def error(value) -> float:
            return float(np.abs(np.asarray(value, np.float64) - exact).max() / np.abs(exact).max())

        errors = [error(default), error(eigen), error(reference), error(x @ weights)]
        cells = " | ".join(f"{e:.2e}" for e in errors)
        print(f"| {rows} | {cells} | {errors[0] / errors[2]:.2f} | {errors[1] / errors[2]:.2f} |")


if __name__ == "__main__":
    main()
