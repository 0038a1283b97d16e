"""Which tokens a bfloat16 comparison of a mixture of experts may hold to the bounds: the rule for routing flips.

A bfloat16 forward, ours or transformers', rounds every value before the router (2^-8 of it, many times over), so
where float64 ranks a token's last chosen expert and its best unchosen one close together, bfloat16 may choose the
other. Neither implementation is wrong then; but the token's mixture output changes by a whole expert, and so does
every value that reads it later: its own later layers, and, through attention, every later token of its sample in
the layers after. Comparing those values against float64 measures the flip, not the arithmetic.

The rule (docs/MODEL.md, "Mixtures of experts", Parity):
1. A *flip* is a (sample, layer, token) whose chosen experts in a bfloat16 run (ours or transformers') differ from
   float64's. Every flip must be *explained*: float64 routes that token within TIE_MARGIN of a tie (its last chosen
   and best unchosen logit closer than TIE_MARGIN times its largest |logit|), or the flip lies downstream of an
   earlier flip (same sample, an earlier layer, the same or an earlier token), whose changed values moved the router's
   input. An unexplained flip fails the test: a router that chose wrongly where the choice is clear.
2. The bounds leave out exactly the values downstream of a flip: at layer l, for token t, those that read a flip at
   an earlier layer at token t or before; and at the flip's own layer, its own token's values from the choice on
   (`expert_weights`, `expert_indices`, `mlp_out`, `resid_post`). Everything else is compared, near ties included.
   Sliding windows, which would narrow what a later token reads, are ignored: the rule leaves out at least what a
   flip reaches.
3. Every output must still compare at least MIN_COMPARED of its tokens, or the seed says too little.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from activations.format import HookPoint, Output

TIE_MARGIN = 2.0**-4
#: The share of an output's tokens the bfloat16 bounds must still compare after the flips' values are left out.
MIN_COMPARED = 0.6
#: A mixture layer's sites computed from its router's choice (the others of the layer are computed before it).
AFTER_CHOICE = ("expert_weights", "expert_indices", "mlp_out", "resid_post")


@dataclasses.dataclass(frozen=True)
class Flip:
    row: int  # the sample
    layer: int
    token: int
    margin: float  # float64's gap between the last chosen and best unchosen logit, over the largest |logit|
    run: str  # "ours" or "transformers'"


def chosen(weights: np.ndarray) -> np.ndarray:
    """The chosen experts of `expert_weights` values [T, E]: their nonzero entries."""
    return weights != 0


def tie_margins(logits: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """Per token, the float64 router's gap between its last chosen and best unchosen logit over its largest |logit|."""
    k = int(choice.sum(axis=1).max())
    ranked = -np.sort(-logits, axis=1)
    return (ranked[:, k - 1] - ranked[:, k]) / np.abs(logits).max(axis=1)


def routing_flips(
    float64: list[dict[Output, np.ndarray]], runs: dict[str, list[dict[Output, np.ndarray]]]
) -> list[Flip]:
    """Every (sample, layer, token) at which a bfloat16 run's chosen experts differ from float64's. `float64` and each
    run in `runs` are per sample: {output: values [T, width]} with the router's sites."""
    flips = []
    for row, wide in enumerate(float64):
        for output in wide:
            if not (isinstance(output, HookPoint) and output.site == "expert_weights"):
                continue
            expected = chosen(wide[output])
            margins = tie_margins(wide[HookPoint("router_logits", output.layer)], expected)
            for run, values in runs.items():
                differs = (chosen(values[row][output]) != expected).any(axis=1)
                flips += [Flip(row, output.layer, int(t), float(margins[t]), run) for t in np.flatnonzero(differs)]
    return flips


def downstream(flip: Flip, row: int, layer: int, token: int, after_choice: bool) -> bool:
    """Whether the value of token `token` of sample `row` at layer `layer` reads `flip` (`after_choice`: a site of
    the layer computed from its router's choice)."""
    if flip.row != row:
        return False
    earlier_layer = flip.layer < layer and flip.token <= token
    return earlier_layer or (flip.layer == layer and flip.token == token and after_choice)


def unexplained(flips: list[Flip]) -> list[Flip]:
    """The flips float64 routes clear of a tie and no earlier flip reaches (rule 1)."""
    return [
        flip for flip in flips
        if flip.margin >= TIE_MARGIN
        and not any(downstream(other, flip.row, flip.layer, flip.token, False) for other in flips)
    ]  # fmt: skip


def compared_tokens(output: Output, lengths: list[int], flips: list[Flip]) -> list[np.ndarray]:
    """Per sample, the tokens of `output` (a hidden state's index, or a layer's HookPoint) that no flip reaches
    (rule 2). Hidden state i is layer i's input."""
    if isinstance(output, HookPoint):
        layer, after = output.layer, output.site in AFTER_CHOICE
    else:
        layer, after = output, False
    return [
        np.array([not any(downstream(f, row, layer, t, after) for f in flips) for t in range(n)], bool)
        for row, n in enumerate(lengths)
    ]  # fmt: skip
