"""A mixture-of-experts MLP as data (`Moe`): what Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE differ in, read from their
config.json by their readers (extract/families.py) and computed by `extract.model.MoeBlock`.

Routing, as transformers' `*TopKRouter` computes it (5.24, e.g. `Qwen2MoeTopKRouter.forward`): router logits
x · W_router; their softmax over every expert, in float32; the top `top_k` of it; those renormalised to sum to 1
where `norm_topk_prob` (Mixtral always); then cast to the compute dtype (Mixtral keeps them in float32). Ties among
equal probabilities go to the higher expert index: transformers leaves them to torch.topk, which does not specify
an order, and on CPU (torch 2.13) chooses the higher index, as tests/extract_model/test_moe.py checks for three tied
experts of four; it lists experts of equal weight in ascending index order (`expert_indices` keeps that order). Every
token goes to its `top_k` experts: there is no capacity, so no token is ever dropped, as in
transformers' evaluation."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Moe:
    num_experts: int
    top_k: int  # experts per token (`num_experts_per_tok`)
    expert_size: int  # each expert's intermediate width
    norm_topk_prob: bool
    #: per decoder layer: True where the MLP is the mixture, False where it is a dense MLP of intermediate_size
    #: (Qwen-MoE's `decoder_sparse_step` and `mlp_only_layers`).
    sparse_layers: tuple[bool, ...]
    #: Qwen2-MoE: a dense expert of this width that every token passes, its output times sigmoid(x · w_gate); 0: none.
    shared_expert_size: int = 0
    #: Mixtral: the chosen weights stay float32 (its router never casts them); the others cast them to the compute
    #: dtype before they scale the experts' outputs.
    float32_weights: bool = False
