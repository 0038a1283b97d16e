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
#: 1/sqrt(head_dim), Gemma 3's local RoPE base and a 1:1 pattern over 3 layers; partial rotary (NeoX, and Phi-4-mini's
#: 0.75 with LongRoPE, whose original context 32 holds the longest sample); one key/value head (Gemma's MQA).
SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=VOCAB, max_position_embeddings=256)  # fmt: skip
#: Gemma 3's multimodal models need a vision tower; this one is as small as it accepts and never runs (text only).
TINY_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
GEMMA3_TEXT = dict(SMALL, head_dim=32, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=24,
                   rope_theta=100000.0, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
FAMILIES: dict[str, dict] = {
    "gpt2": dict(SMALL, n_inner=128),
    "gpt_neox": dict(SMALL, rotary_pct=0.5, rotary_emb_base=5000),
    "llama": dict(SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": dict(SMALL, sliding_window=5),
    "qwen2": dict(SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(SMALL, head_dim=32),
    "phi3": dict(SMALL, sliding_window=5, partial_rotary_factor=0.75, original_max_position_embeddings=32,
                 pad_token_id=0, rope_scaling={"type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
                                               "long_factor": [8.0] * 6}),
    "olmo2": dict(SMALL, rope_theta=500000.0, pad_token_id=0),
    "gemma": dict(SMALL, head_dim=32, num_key_value_heads=1, hidden_act="gelu"),
    "gemma2": dict(SMALL, head_dim=16, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=3.0),
    "gemma3_text": GEMMA3_TEXT,
    "gemma3": dict(text_config=dict(GEMMA3_TEXT, model_type="gemma3_text"), vision_config=TINY_VISION,
                   mm_tokens_per_image=4),
    # Mixtures of experts: four experts, two a token, so that every expert is chosen in the parity samples; Qwen2-MoE
    # with its shared expert and a dense layer between sparse ones, Qwen3-MoE renormalising its top-k weights.
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
    "qwen2_moe": dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, mlp_only_layers=[1]),
    "qwen3_moe": dict(SMALL, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    "olmoe": dict(SMALL, num_experts=4, num_experts_per_tok=2, pad_token_id=0),
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
    "GPT-2 small": ("gpt2", dict(n_embd=768, n_head=12, n_positions=1024, layer_norm_epsilon=1e-5,
                                 activation_function="gelu_new")),
    "Pythia-1.4B": ("gpt_neox", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, rotary_pct=0.25, rotary_emb_base=10000,
        use_parallel_residual=True, hidden_act="gelu", layer_norm_eps=1e-5, max_position_embeddings=2048)),
    "Phi-3-mini": ("phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=2047,
        pad_token_id=0)),
    # Phi-4-mini's LongRoPE factors are a released list of 48; these are of its shape and range.
    "Phi-4-mini": ("phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
        partial_rotary_factor=0.75, sliding_window=262144, pad_token_id=0, rope_scaling={
            "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(48)],
            "long_factor": [1.0 + 0.5 * i for i in range(48)]})),
    "OLMo-2-7B": ("olmo2", dict(
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_theta=500000.0, pad_token_id=0)),
    "Gemma-2B": ("gemma", dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        hidden_act="gelu", rms_norm_eps=1e-6, max_position_embeddings=8192, rope_theta=10000.0)),
    # Gemma 3 4B as released: a multimodal config whose text_config gives only what differs from the defaults; its
    # two layers here are one sliding and one global (with the linear-scaled RoPE), as its 34 alternate 5:1.
    "Gemma-3-4B": ("gemma3", dict(text_config=dict(
        model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, sliding_window=1024,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, layer_types=["sliding_attention", "full_attention"]),
        vision_config=TINY_VISION, mm_tokens_per_image=4)),
    # Mixtures at their released widths, every expert (their config.json's sizes and routing).
    "Mixtral-8x7B": ("mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=1e6, sliding_window=None)),
    "Qwen3-30B-A3B": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_theta=1e6)),
    "OLMoE-1B-7B": ("olmoe", dict(
        hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_theta=10000.0, pad_token_id=1)),
}  # fmt: skip
#: The real shapes' layers and sample lengths (the bench's --real and the real_shape tests).
REAL_LAYERS = {"Llama-3.1-8B": 1, "OLMo-2-7B": 1, "Mixtral-8x7B": 1, "Qwen3-30B-A3B": 1}  # the widest: one layer
REAL_LENGTHS = [32, 20]


def write_real_model(directory: pathlib.Path, name: str, seed: int = 3) -> FamilyModel:
    """A released shape of REAL (its config alone: nothing of the small configs) with a small vocabulary and its few
    layers (REAL_LAYERS, else two), saved by transformers as one file."""
    model_type, shape = REAL[name]
    small = dict(vocab_size=256, num_hidden_layers=REAL_LAYERS.get(name, 2))
    if model_type == "gemma3":
        shape = dict(shape, text_config=dict(shape["text_config"], **small))
    else:
        shape = dict(shape, **small)
    return write_family_model(directory, model_type, seed=seed, shard_size=None, base={}, **shape)


@dataclasses.dataclass
class FamilyModel:
    path: pathlib.Path
    torch_model: torch.nn.Module  # float32, eager attention
    num_hidden_layers: int

    @property
    def sites(self) -> list[str]:
        """The hook sites transformers' first layer of this family has (no resid_mid where attention and MLP are
        parallel)."""
        return self.layer_sites(0)

    def layer_sites(self, layer: int) -> list[str]:
        """The hook sites of transformers' layer `layer` (a mixture of experts has the router's, and no mlp_hidden)."""
        return [site for site in SITES if site in _site_modules(decoder_layers(self.torch_model)[layer])]

    @property
    def vocab_size(self) -> int:
        config = self.torch_model.config
        return getattr(config, "text_config", config).vocab_size

    def every_output(self) -> list[Output]:
        """Every hidden state and every site of every layer."""
        layers = range(self.num_hidden_layers)
        return [*range(self.num_hidden_layers + 1),
                *(HookPoint(site, layer) for layer in layers for site in self.layer_sites(layer))]  # fmt: skip

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


def _is_norm_scale(name: str) -> bool:
    leaf = name.rsplit(".", 2)[-2:]
    return leaf[-1] == "weight" and ("norm" in leaf[0] or leaf[0].startswith("ln_"))


def write_family_model(
    directory: pathlib.Path,
    model_type: str,
    *,
    seed: int = 0,
    shard_size: str | None = "100KB",
    base: dict | None = None,
    **overrides,
) -> FamilyModel:
    """A checkpoint saved by transformers' `save_pretrained`, its weights redrawn so that norms and biases are not
    the identity (a loader that dropped them would pass otherwise). The config is `base` (by default the family's
    small config in FAMILIES, or SMALL) updated with `overrides`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(seed)
    base = FAMILIES.get(model_type, SMALL) if base is None else base
    config = AutoConfig.for_model(model_type, **{**base, **overrides})
    config._attn_implementation = "eager"
    # A mixture's experts one by one, as transformers' eager loop runs them (its default grouped matmul has no
    # float64 kernel for the reference).
    config._experts_implementation = "eager"
    with no_init_weights():  # every parameter is drawn below; at a real width transformers' own init is slow
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_norm_scale(name):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1 if param.shape[-1] < 1024 else 0.02)
    model.eval()
    model.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    text = getattr(config, "text_config", config)
    return FamilyModel(directory, model, text.num_hidden_layers)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """transformers' decoder layers: `model.layers` (GPT-2: `transformer.h`; a multimodal Gemma 3's language model)."""
    base = model.base_model
    base = getattr(base, "language_model", base)
    return base.layers if hasattr(base, "layers") else base.h


def reference_outputs(model: torch.nn.Module, token_ids: list[int], num_hidden_layers: int) -> dict[Output, np.ndarray]:
    """Every hidden state (`output_hidden_states`) and every hook site (forward hooks), as float64 numpy [T, width]."""
    captured: dict[Output, torch.Tensor] = {}
    with contextlib.ExitStack() as hooks:
        for layer, block in enumerate(decoder_layers(model)):
            for site, (module, kind) in _site_modules(block).items():
                hooks.enter_context(_hook(module, kind, captured, HookPoint(site, layer)))
        with torch.inference_mode():
            out = model(torch.tensor([token_ids], dtype=torch.long), output_hidden_states=True)
    captured.update(enumerate(out.hidden_states))
    assert len(out.hidden_states) == num_hidden_layers + 1
    return {k: v[0].double().numpy() for k, v in captured.items()}


def _site_modules(block: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Where each site is in transformers' decoder layer, by its module layout: (module, "input" or "output").

    The attention's output is the norm on it where there is one (Gemma 2 and 3, OLMo 2: `post_attention_layernorm`
    when a `post_feedforward_layernorm` exists), else the attention's; likewise the MLP's. The residual stream
    between them is the input of the MLP's pre-norm (Llama's `post_attention_layernorm`, Gemma's
    `pre_feedforward_layernorm`, GPT-2's `ln_2`), or of the MLP itself where it has none (OLMo 2); NeoX's layers in
    parallel have no such stream."""
    attention = next(getattr(block, n) for n in ("self_attn", "attention", "attn") if hasattr(block, n))
    mlp = block.mlp
    moe = hasattr(mlp, "experts")  # a mixture of experts: its router is `mlp.gate` (a *TopKRouter)
    down = None if moe else next(getattr(mlp, n) for n in ("down_proj", "dense_4h_to_h", "c_proj") if hasattr(mlp, n))
    post_norms = hasattr(block, "post_feedforward_layernorm")
    if post_norms:
        pre_mlp = getattr(block, "pre_feedforward_layernorm", None)
    else:
        pre_mlp = getattr(block, "post_attention_layernorm", None) or getattr(block, "ln_2")
    sites = {
        "resid_pre": (block, "input"),
        "attn_out": (block.post_attention_layernorm, "output") if post_norms else (attention, "output"),
        "resid_mid": (pre_mlp if pre_mlp is not None else mlp, "input"),
        "mlp_in": (mlp, "input"),
        "mlp_hidden": (down, "input"),
        "mlp_out": (block.post_feedforward_layernorm, "output") if post_norms else (mlp, "output"),
        "resid_post": (block, "output"),
        "router_logits": (getattr(mlp, "gate", None), "router_logits"),
        "expert_weights": (getattr(mlp, "gate", None), "expert_weights"),
        "expert_indices": (getattr(mlp, "gate", None), "expert_indices"),
    }
    for site in ("router_logits", "expert_weights", "expert_indices") if not moe else ("mlp_hidden",):
        del sites[site]
    if getattr(block, "use_parallel_residual", False):
        del sites["resid_mid"]
    return sites


@contextlib.contextmanager
def _hook(module: torch.nn.Module, kind: str, captured: dict, key: HookPoint):
    def first(value):
        return value[0] if isinstance(value, tuple) else value

    if kind in ("router_logits", "expert_weights", "expert_indices"):

        def router(module, _args, output):
            # The router returns (logits, the chosen experts' weights, their indices), over the batch's tokens; the
            # indices as torch.topk sorts them, heaviest first.
            logits, weights, chosen = output
            if kind == "router_logits":
                captured[key] = logits[None]
            elif kind == "expert_indices":
                captured[key] = chosen[None]
            else:
                captured[key] = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, chosen, weights)[None]

        handle = module.register_forward_hook(router)
    elif kind == "input":

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


def respell(directory: pathlib.Path, old: str, new: str) -> None:
    """Rename the checkpoint's tensors from prefix `old` to `new`, in place (its safetensors files and index): the
    same weights as another version of transformers would have saved them."""
    import json

    from safetensors.numpy import load_file, save_file

    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(path))
        save_file({new + k[len(old):] if k.startswith(old) else k: v for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})  # fmt: skip
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {new + k[len(old):] if k.startswith(old) else k: v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
