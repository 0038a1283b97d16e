"""The parity table of docs/MODEL.md: per family and hook site, how far our float32 and bfloat16 forwards are from
transformers' float64 forward of the same weights, beside transformers' own float32 and bfloat16 forwards.

The models, samples and references are those of tests/extract_model/test_family_parity.py (random weights saved by
transformers, forward hooks on its modules, a right-padded batch). Per output, over valid tokens:
- float32: max |x - float64| / max |float64| (ours, then transformers');
- bfloat16: the smallest cosine to float64 over tokens (ours, then transformers').
Each cell is the worst over the layers of its site ("hidden" is hidden states 0..L-1, "final norm" is L).

    python bench/parity_table.py            # the six families at small shapes
    python bench/parity_table.py --real     # Llama-3.1-8B and Gemma-2-2B widths, one and two layers
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from activations.format import SITES, HookPoint
from tests.extract_model.families import FAMILIES, REAL, write_family_model
from tests.extract_model.test_family_parity import LENGTHS, cosine, references, run_engine


def row_name(output, num_hidden_layers: int) -> str:
    if isinstance(output, HookPoint):
        return output.site
    return "final norm" if output == num_hidden_layers else "hidden"


def measure(model, refs) -> dict[str, list[float]]:
    """Per row name: [fp32 max rel. error ours, transformers'; bf16 min cosine ours, transformers']."""
    ours32, ours16 = run_engine(model, refs, "float32"), run_engine(model, refs, "bfloat16")
    worst: dict[str, list[float]] = {}
    for output in ours32:
        rel = [0.0, 0.0]
        cos = [1.0, 1.0]
        for row, sample in enumerate(refs.samples):
            n = len(sample)
            wide = refs.float64[row][output]
            scale = float(np.abs(wide).max()) or 1.0
            rel[0] = max(rel[0], float(np.abs(ours32[output][row, :n] - wide).max()) / scale)
            rel[1] = max(rel[1], float(np.abs(refs.float32[row][output] - wide).max()) / scale)
            cos[0] = min(cos[0], float(cosine(ours16[output][row, :n], wide).min()))
            cos[1] = min(cos[1], float(cosine(refs.bfloat16[row][output], wide).min()))
        key = row_name(output, model.num_hidden_layers)
        before = worst.get(key, [0.0, 0.0, 1.0, 1.0])
        worst[key] = [max(before[0], rel[0]), max(before[1], rel[1]), min(before[2], cos[0]), min(before[3], cos[1])]
    return worst


COLUMNS = ["hidden", *SITES, "final norm"]


def print_tables(results: dict[str, dict[str, list[float]]]) -> None:
    """Two markdown tables, a model a row and a site a column: each cell "ours / transformers'"."""
    header = "| model | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS)
    print("float32: max |x - float64| / max |float64|, ours / transformers' float32\n\n" + header)
    for name, worst in results.items():
        print(f"| {name} | " + " | ".join(f"{worst[c][0]:.1e} / {worst[c][1]:.1e}" for c in COLUMNS) + " |")
    print("\nbfloat16: the smallest cosine to float64 over tokens, ours / transformers' bfloat16\n\n" + header)
    for name, worst in results.items():
        print(f"| {name} | " + " | ".join(f"{worst[c][2]:.5f} / {worst[c][3]:.5f}" for c in COLUMNS) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="the released widths instead of the small shapes")
    args = parser.parse_args()
    cases = (
        [(name, REAL[name][0], dict(REAL[name][1], vocab_size=256, num_hidden_layers=layers), [32, 20])
         for name, layers in (("Llama-3.1-8B", 1), ("Gemma-2-2B", 2))]
        if args.real else [(family, family, {}, LENGTHS) for family in FAMILIES]
    )  # fmt: skip
    results = {}
    for name, model_type, overrides, lengths in cases:
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            seed = 3 if args.real else 7  # as in the test
            model = write_family_model(Path(scratch), model_type, seed=seed, shard_size=None, **overrides)
            layers = model.num_hidden_layers
            label = f"{name} width, {layers} layer{'s' * (layers > 1)}" if args.real else name
            results[label] = measure(model, references(model, lengths))
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    print_tables(results)


if __name__ == "__main__":
    main()
