"""SAELens on our activations: its real trainer fed by the loader, and its real cache loader reading our export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from activations.loader import ActivationLoader
from activations.reader import open_activations
from tests.workers import REPO

sae_lens = pytest.importorskip("sae_lens")
torch = pytest.importorskip("torch")


def reconstruction_loss(sae, x) -> float:
    """SAELens's mse_loss: squared error summed over dimensions, averaged over tokens."""
    with torch.no_grad():
        return float(((x - sae(x)) ** 2).sum(-1).mean())


def explained_variance(sae, x) -> float:
    with torch.no_grad():
        reconstruction = sae(x)
    return float(1 - ((x - reconstruction) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())


def test_saelens_trainer_learns_from_the_loader_stream(extracted_job):
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig

    from activations.saelens import data_provider

    torch.manual_seed(0)
    loader = ActivationLoader(str(extracted_job.queue), layers=extracted_job.layer, batch_size=256, shuffle_tokens=2048,
                              epochs=None, output="torch", normalize="mean_norm", seed=0)  # fmt: skip
    # A batch of the job drawn with another seed, to score the SAE on before and after training.
    probe = next(ActivationLoader(str(extracted_job.queue), layers=extracted_job.layer, batch_size=2048,
                                  shuffle_tokens=4096, seed=99, output="torch", normalize="mean_norm"))  # fmt: skip
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=extracted_job.hidden, d_sae=4 * extracted_job.hidden,
                                                        l1_coefficient=0.5, normalize_activations="none"))  # fmt: skip
    steps = 300
    cfg = SAETrainerConfig(total_training_samples=steps * 256, train_batch_size_samples=256, lr=1e-3, lr_end=1e-3,
                           device="cpu", logger=LoggingConfig(log_to_wandb=False))  # fmt: skip
    before = reconstruction_loss(sae, probe)
    SAETrainer(cfg=cfg, sae=sae, data_provider=data_provider(loader)).fit()
    after, variance = reconstruction_loss(sae, probe), explained_variance(sae, probe)
    print(f"saelens: {steps} steps x 256 tokens; mse_loss on a batch of the job {before:.2f} -> {after:.2f}, "
          f"explained_variance {variance:.3f}")
    assert after < 0.3 * before
    assert variance > 0.5


def test_export_is_read_by_saelens_cached_activations_store(extracted_job, tmp_path):
    from sae_lens.training.activations_store import ActivationsStore

    out = tmp_path / "saelens"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "tools/export.py", str(extracted_job.queue), "--format", "saelens", str(out),
                             "--layer", "2", "--context-size", "16"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["hook"] == "blocks.1.hook_resid_post"
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name="blocks.1.hook_resid_post", hook_head_index=None,
        context_size=16, d_in=extracted_job.hidden, n_batches_in_buffer=2, total_training_tokens=1000,
        store_batch_size_prompts=4, train_batch_size_tokens=32, prepend_bos=False, normalize_activations="none",
        device=torch.device("cpu"), dtype="float32", cached_activations_path=str(out),
    )  # fmt: skip
    acts, token_ids = store.get_raw_llm_batch()
    assert tuple(acts.shape) == (4 * 16, extracted_job.hidden) and tuple(token_ids.shape) == (4 * 16,)
    reference = open_activations(str(extracted_job.queue))
    expected = np.asarray(reference.layer(2)[: 4 * 16], np.float32)
    assert np.array_equal(acts.numpy(), expected)
    assert np.array_equal(token_ids.numpy(), reference.token_ids()[: 4 * 16])
    assert summary["rows"] == reference.num_tokens // 16
    # SAELens has no place for positions and reads only its two columns; the export's third one holds them.
    import datasets

    positions = np.asarray(datasets.load_from_disk(str(out))["positions"])
    assert positions.shape == (summary["rows"], 16)
    assert np.array_equal(positions.reshape(-1), reference.positions()[: summary["rows"] * 16])
