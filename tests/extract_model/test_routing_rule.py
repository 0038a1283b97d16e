"""The rule by which a mixture's bfloat16 parity leaves out tokens routed otherwise than float64 (routing.py), on
routing data written by hand: which flips it finds, which it accepts, and exactly which values it leaves out."""

from __future__ import annotations

import numpy as np

from activations.format import HookPoint
from tests.extract_model.routing import TIE_MARGIN, Flip, compared_tokens, routing_flips, tie_margins, unexplained


def _sample(logits: list[list[float]], k: int = 2) -> dict:
    """One sample's router sites of layer 0, float64's choice being the top `k` logits."""
    logits = np.array(logits)
    weights = np.zeros_like(logits)
    for t, row in enumerate(logits):
        weights[t, np.argsort(-row)[:k]] = 1.0 / k
    return {HookPoint("router_logits", 0): logits, HookPoint("expert_weights", 0): weights}


def test_a_flip_is_a_token_whose_chosen_experts_differ_from_float64s_with_its_margin_to_a_tie():
    wide = _sample([[4.0, 3.0, 2.9, 0.0], [4.0, 3.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    run = {key: value.copy() for key, value in wide.items()}
    run[HookPoint("expert_weights", 0)][0] = [0.5, 0.0, 0.5, 0.0]  # token 0: expert 2 for 1, a near tie
    flips = routing_flips([wide], {"ours": [run], "transformers'": [wide]})
    assert [(f.row, f.layer, f.token, f.run) for f in flips] == [(0, 0, 0, "ours")]
    assert abs(flips[0].margin - 0.1 / 4.0) < 1e-12
    margins = tie_margins(wide[HookPoint("router_logits", 0)], wide[HookPoint("expert_weights", 0)] != 0)
    np.testing.assert_allclose(margins, [0.025, 0.5, 0.25])


def test_a_flip_leaves_out_its_tokens_own_values_from_the_choice_on_and_every_later_tokens_in_later_layers():
    flip = Flip(row=0, layer=1, token=2, margin=0.01, run="ours")
    lengths = [5, 4]

    def left_out(output):
        return [np.flatnonzero(~mask).tolist() for mask in compared_tokens(output, lengths, [flip])]

    # Before the choice, in the flip's layer and before it: nothing.
    for output in (0, 1, HookPoint("resid_pre", 1), HookPoint("attn_out", 1), HookPoint("mlp_in", 1),
                   HookPoint("router_logits", 1), HookPoint("mlp_out", 0)):  # fmt: skip
        assert left_out(output) == [[], []], output
    # From the choice on, in its layer: its own token only (the mixture is per token).
    for site in ("expert_weights", "mlp_out", "resid_post"):
        assert left_out(HookPoint(site, 1)) == [[2], []], site
    # In later layers attention carries it to every later token of its sample, never to another sample.
    for output in (2, HookPoint("resid_pre", 2), HookPoint("attn_out", 2), HookPoint("router_logits", 3)):
        assert left_out(output) == [[2, 3, 4], []], output


def test_a_flip_clear_of_a_tie_is_unexplained_unless_an_earlier_flip_reaches_it():
    clear = Flip(row=1, layer=2, token=3, margin=4 * TIE_MARGIN, run="transformers'")
    near = Flip(row=1, layer=2, token=3, margin=TIE_MARGIN / 2, run="ours")
    assert unexplained([near]) == []
    assert unexplained([clear]) == [clear]
    reaching = [Flip(1, 0, 3, 0.01, "ours"), Flip(1, 1, 0, 0.01, "ours")]  # an earlier layer, same or earlier token
    for earlier in reaching:
        assert unexplained([earlier, clear]) == [], earlier
    not_reaching = [Flip(1, 1, 4, 0.01, "ours"), Flip(0, 1, 0, 0.01, "ours"), Flip(1, 2, 0, 0.01, "ours")]
    for other in not_reaching:  # a later token, another sample, the same layer
        assert unexplained([other, clear]) == [clear], other
