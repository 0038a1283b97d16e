"""Tiny random Qwen checkpoints written by transformers itself, and its PyTorch forward as the numerical reference.

Weights are redrawn after construction (transformers initialises biases to zero and norms to one, which would let
a loader that drops them pass), and saved as several safetensors shards with an index, like real checkpoints.
"""

from __future__ import annotations

import os

# The top-level conftest normally does this; repeated here so this directory also runs on its own.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

VOCAB = 300


@dataclasses.dataclass
class TinyModel:
    path: pathlib.Path
    torch_model: torch.nn.Module
    num_hidden_layers: int

    def reference(self, token_ids: list[int]) -> list[np.ndarray]:
        """transformers' hidden states (float32) for one unpadded sample: index -> [T, hidden]."""
        with torch.inference_mode():
            out = self.torch_model(torch.tensor([token_ids], dtype=torch.long), output_hidden_states=True)
        return [h[0].numpy() for h in out.hidden_states]

    def reference64(self, token_ids: list[int]) -> list[np.ndarray]:
        """The same forward in float64 (a copy of the model, its float32 weights widened): the values float32
        rounding is measured against."""
        import copy

        wide = copy.deepcopy(self.torch_model).double()
        with torch.inference_mode():
            out = wide(torch.tensor([token_ids], dtype=torch.long), output_hidden_states=True)
        return [h[0].numpy() for h in out.hidden_states]


def write_tiny_model(
    directory: pathlib.Path,
    model_type: str,
    *,
    tie: bool = False,
    layers: int = 3,
    head_dim: int | None = None,
    seed: int = 0,
    shard_size: str | None = "100KB",
    **extra,
) -> TinyModel:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    common.update(extra)  # extra may also override a size
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim or 16, **common))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    model.eval()
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return TinyModel(directory, model, layers)


@pytest.fixture(scope="session")
def qwen2_untied(tmp_path_factory) -> TinyModel:
    return write_tiny_model(tmp_path_factory.mktemp("qwen2_untied"), "qwen2", tie=False, seed=1)


@pytest.fixture(scope="session")
def qwen2_tied(tmp_path_factory) -> TinyModel:
    return write_tiny_model(tmp_path_factory.mktemp("qwen2_tied"), "qwen2", tie=True, seed=2, shard_size=None)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> TinyModel:
    # head_dim 32 with hidden 64 and 4 heads: an explicit head_dim that is not hidden / heads, as in Qwen3.
    return write_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=True, head_dim=32, seed=3)


def ragged_batch(rng: np.random.Generator, lengths: list[int], pad_id: int = 0) -> tuple[np.ndarray, list[list[int]]]:
    """Right-padded int32 batch of samples with the given lengths; also the unpadded samples."""
    samples = [rng.integers(1, VOCAB, n).tolist() for n in lengths]
    batch = np.full((len(lengths), max(lengths)), pad_id, dtype=np.int32)
    for row, sample in enumerate(samples):
        batch[row, : len(sample)] = sample
    return batch, samples
