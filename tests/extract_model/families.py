"""Checkpoints of every supported family written by transformers itself, and transformers' own activations at every
hook site, taken with forward hooks on its PyTorch modules: the reference the parity tests hold us to.

The hooks know transformers' module layout, not ours: where each site is in `LlamaDecoderLayer`,
`Gemma2DecoderLayer`, ... (module inputs and outputs), so they check our reading of what each site means too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import numpy as np
import torch

from activations.format import SITES, HookPoint, Output

VOCAB = 300

#: Small configs that make each family's differences matter at a few tokens: windows shorter than the samples,
#: scaled RoPE with a short original context, a soft-cap below the logits' size, a query scale that is not
#: 1/sqrt(head_dim), Gemma 3's local RoPE base and a 1:1 pattern over 3 layers.
SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=VOCAB, max_position_embeddings=256)  # fmt: skip
FAMILIES: dict[str, dict] = {
    "qwen2": dict(SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(SMALL, head_dim=32),
    "llama": dict(SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": dict(SMALL, sliding_window=5),
    "gemma2": dict(SMALL, head_dim=16, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=3.0),
    "gemma3_text": dict(SMALL, head_dim=32, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=24,
                        rope_theta=100000.0, rope_local_base_freq=500.0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}),
}  # fmt: skip

#: Released models' shapes (their config.json, with a small vocabulary and few layers: the width is what matters).
REAL = {
    "Llama-3.1-8B": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "Gemma-2-2B": ("gemma2", dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, sliding_window=4096, rms_norm_eps=1e-6,
        max_position_embeddings=8192, rope_theta=10000.0)),
}  # fmt: skip


@dataclasses.dataclass
class FamilyModel:
    path: pathlib.Path
    torch_model: torch.nn.Module  # float32, eager attention
    num_hidden_layers: int

    def every_output(self) -> list[Output]:
        """Every hidden state and every site of every layer."""
        layers = range(self.num_hidden_layers)
        return [*range(self.num_hidden_layers + 1), *(HookPoint(site, layer) for layer in layers for site in SITES)]

    def reference(self, token_ids: list[int], dtype: torch.dtype = torch.float32) -> dict[Output, np.ndarray]:
        """transformers' activations for one unpadded sample, every output, as float64 numpy [T, width], from the
        model run in `dtype`: float32; float64 (its float32 weights widened in place, exactly, and narrowed back);
        or bfloat16 (a rounded copy)."""
        if dtype == torch.bfloat16:
            import copy

            return reference_outputs(copy.deepcopy(self.torch_model).to(dtype), token_ids, self.num_hidden_layers)
        self.torch_model.to(dtype)
        try:
            return reference_outputs(self.torch_model, token_ids, self.num_hidden_layers)
        finally:
            self.torch_model.to(torch.float32)


def write_family_model(
    directory: pathlib.Path, model_type: str, *, seed: int = 0, shard_size: str | None = "100KB", **overrides
) -> FamilyModel:
    """A checkpoint saved by transformers' `save_pretrained`, its weights redrawn so that norms and biases are not
    the identity (a loader that dropped them would pass otherwise)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**FAMILIES.get(model_type, SMALL), **overrides})
    config._attn_implementation = "eager"
    with no_init_weights():  # every parameter is drawn below; at a real width transformers' own init is slow
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1 if param.shape[-1] < 1024 else 0.02)
    model.eval()
    model.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return FamilyModel(directory, model, config.num_hidden_layers)


def reference_outputs(model: torch.nn.Module, token_ids: list[int], num_hidden_layers: int) -> dict[Output, np.ndarray]:
    """Every hidden state (`output_hidden_states`) and every hook site (forward hooks), as float64 numpy [T, width]."""
    captured: dict[Output, torch.Tensor] = {}
    with contextlib.ExitStack() as hooks:
        for layer, block in enumerate(model.model.layers):
            for site, (module, kind) in _site_modules(block).items():
                hooks.enter_context(_hook(module, kind, captured, HookPoint(site, layer)))
        with torch.inference_mode():
            out = model(torch.tensor([token_ids], dtype=torch.long), output_hidden_states=True)
    captured.update(enumerate(out.hidden_states))
    assert len(out.hidden_states) == num_hidden_layers + 1
    return {k: v[0].double().numpy() for k, v in captured.items()}


def _site_modules(block: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Where each site is in transformers' decoder layer: (module, "input" or "output"). Gemma's
    `post_attention_layernorm` norms the attention's output; Llama's (Qwen's, Mistral's) is the MLP's input norm."""
    sandwich = hasattr(block, "pre_feedforward_layernorm")
    return {
        "resid_pre": (block, "input"),
        "attn_out": (block.post_attention_layernorm, "output") if sandwich else (block.self_attn, "output"),
        "resid_mid": (block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm, "input"),
        "mlp_in": (block.mlp, "input"),
        "mlp_hidden": (block.mlp.down_proj, "input"),
        "mlp_out": (block.post_feedforward_layernorm, "output") if sandwich else (block.mlp, "output"),
        "resid_post": (block, "output"),
    }


@contextlib.contextmanager
def _hook(module: torch.nn.Module, kind: str, captured: dict, key: HookPoint):
    def first(value):
        return value[0] if isinstance(value, tuple) else value

    if kind == "input":

        def pre(_module, args, kwargs):
            captured[key] = first(args) if args else kwargs["hidden_states"]

        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(_module, _args, output):
            captured[key] = first(output)

        handle = module.register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()
