"""The parity table of docs/MODEL.md: per family and hook site, how far our float32 and bfloat16 forwards are from
transformers' float64 forward of the same weights, beside transformers' own float32 and bfloat16 forwards.

The models, samples and references are those of tests/extract_model/test_family_parity.py (random weights saved by
transformers, forward hooks on its modules, a right-padded batch). Per output, over valid tokens:
- float32: max |x - float64| / max |float64| (ours, then transformers');
- bfloat16: the smallest cosine to float64 over tokens (ours, then transformers').
Each cell is the worst over the layers of its site ("hidden" is hidden states 0..L-1, "final norm" is L). The
bfloat16 figures of a mixture leave out the values downstream of a token routed otherwise than float64 (a flip, by
ours or transformers'), as the tests' bounds do (tests/extract_model/routing.py); the summary counts the flips and
those not explained by a near-tie (the tests fail on any).

    python bench/parity_table.py                    # every family at small shapes
    python bench/parity_table.py --real             # the released widths (tests/extract_model/families.py, REAL)
    python bench/parity_table.py --real Pythia-1.4B # some of them

A site a family does not have (NeoX's resid_mid) is "-". Run it niced: the real widths hold a transformers model in
float32 and float64 and our engine at once (a few GB at the 7B-8B widths).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from activations.format import SITES, HookPoint
from tests.extract_model.families import FAMILIES, REAL, REAL_LENGTHS, write_family_model, write_real_model
from tests.extract_model.routing import compared_tokens, unexplained
from tests.extract_model.test_family_parity import (
    LENGTHS, bf16_errors, bf16_flips, cosine, float32_errors, references, run_engine,
)


def row_name(output, num_hidden_layers: int) -> str:
    if isinstance(output, HookPoint):
        return output.site
    return "final norm" if output == num_hidden_layers else "hidden"


def measure(model, refs) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
    """Per row name: [fp32 max rel. error ours, transformers'; bf16 min cosine ours, transformers']; and the
    summary of the tests' bounds over every output: (lowest, highest) of our float32 error over transformers',
    of our largest error over the largest value, and of our bf16 mean and worst 1 - cosine over transformers';
    the routing flips in bfloat16 (ours, transformers') and how many no near-tie explains."""
    # transformers' model is no longer needed (its references are taken): at Mixtral-8x7B's width its float32
    # weights are 5.6 GB a layer, which our engine's copy need not sit beside (the module's structure stays: it
    # names the sites).
    model.torch_model.to("meta")
    ours32, ours16 = run_engine(model, refs, "float32"), run_engine(model, refs, "bfloat16")
    flips = bf16_flips(ours16, refs)
    compared = {output: compared_tokens(output, [len(s) for s in refs.samples], flips) for output in ours16}
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
            kept = compared[output][row]
            if kept.any():
                cos[0] = min(cos[0], float(cosine(ours16[output][row, :n], wide)[kept].min()))
                cos[1] = min(cos[1], float(cosine(refs.bfloat16[row][output], wide)[kept].min()))
        key = row_name(output, model.num_hidden_layers)
        before = worst.get(key, [0.0, 0.0, 1.0, 1.0])
        worst[key] = [max(before[0], rel[0]), max(before[1], rel[1]), min(before[2], cos[0]), min(before[3], cos[1])]
    f32, bf16 = float32_errors(ours32, refs), bf16_errors(ours16, refs, compared)
    ratios = {
        "float32 ours / transformers'": [m / t for m, t, _ in f32.values() if t > 0],
        "float32 max error / max value": [m / v for m, _, v in f32.values() if v > 0],
        "bf16 mean e ours / transformers'": [m / t for m, t, _, _ in bf16.values() if t > 0],
        "bf16 worst e ours / transformers'": [m / t for _, _, m, t in bf16.values() if t > 0],
    }
    summary = {name: (min(values), max(values)) for name, values in ratios.items()}
    summary["bf16 flips ours, transformers' (unexplained)"] = (
        sum(f.run == "ours" for f in flips), sum(f.run != "ours" for f in flips), len(unexplained(flips)))
    return worst, summary


COLUMNS = ["hidden", *SITES, "final norm"]


def print_tables(results: dict[str, dict[str, list[float]]], summaries: dict[str, dict[str, tuple]]) -> None:
    """The bounds' summary, a model a row; then two markdown tables, a model a row and a site a column: each cell
    "ours / transformers'"."""
    names = list(next(iter(summaries.values())))
    print("| model | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for model, summary in summaries.items():
        cells = [f"{v[0]}, {v[1]} ({v[2]})" if "flips" in name else f"{v[0]:.1e}–{v[1]:.1e}" if "value" in name
                 else f"{v[0]:.2f}–{v[1]:.2f}" for name, v in summary.items()]  # fmt: skip
        print(f"| {model} | " + " | ".join(cells) + " |")
    print()
    header = "| model | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS)
    print("float32: max |x - float64| / max |float64|, ours / transformers' float32\n\n" + header)
    for name, worst in results.items():
        print(f"| {name} | " + " | ".join(f"{worst[c][0]:.1e} / {worst[c][1]:.1e}" if c in worst else "-"
                                          for c in COLUMNS) + " |")  # fmt: skip
    # The chosen experts' indices are no direction: a cosine of them says nothing (in bfloat16 two chosen experts of
    # nearly equal weight can come in the other order, which gives a cosine near 0); the float32 table shows whether
    # they are identical.
    print("\nbfloat16: the smallest cosine to float64 over tokens, ours / transformers' bfloat16\n\n" + header)
    for name, worst in results.items():
        print(f"| {name} | " + " | ".join(f"{worst[c][2]:.5f} / {worst[c][3]:.5f}" if c in worst
                                          and c != "expert_indices" else "-"
                                          for c in COLUMNS) + " |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", nargs="*", metavar="NAME", help=f"the released widths: {', '.join(REAL)} (all)")
    args = parser.parse_args()
    if args.real is not None:
        unknown = sorted(set(args.real) - set(REAL))
        if unknown:
            parser.error(f"unknown real shape {', '.join(unknown)}; known: {', '.join(REAL)}")
        names, lengths = args.real or list(REAL), REAL_LENGTHS
    else:
        names, lengths = list(FAMILIES), LENGTHS
    results, summaries = {}, {}
    for name in names:
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            if args.real is not None:  # the models and seeds of the tests
                model = write_real_model(Path(scratch), name)
            else:
                model = write_family_model(Path(scratch), name, seed=7, shard_size=None)
            layers = model.num_hidden_layers
            label = f"{name} width, {layers} layer{'s' * (layers > 1)}" if args.real is not None else name
            results[label], summaries[label] = measure(model, references(model, lengths))
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    print_tables(results, summaries)


if __name__ == "__main__":
    main()
