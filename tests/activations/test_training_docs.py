"""docs/TRAINING.md's examples, run as written against a small generated job (SOURCE, LAYER and STEPS replaced)."""

from __future__ import annotations

import math
import pathlib
import re

import pytest

from tests.workers import REPO

DOC = REPO / "docs" / "TRAINING.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def adapted(code: str, source: str, layer: int, steps: int) -> str:
    """The example with its first line of settings pointed at the test job; everything else runs as written."""
    settings = re.search(r"^SOURCE, LAYER, STEPS(, BATCH)? = .*$", code, flags=re.M)
    assert settings, "each example starts its settings with `SOURCE, LAYER, STEPS = ...`"
    batch = ", 64" if settings.group(1) else ""
    line = f"SOURCE, LAYER, STEPS{settings.group(1) or ''} = {source!r}, {layer}, {steps}{batch}"
    code = code.replace(settings.group(0), line)
    return code.replace("shuffle_tokens=1 << 18", "shuffle_tokens=256").replace("batch_size=4096", "batch_size=64")


def test_docs_hold_a_saelens_and_a_pytorch_example_of_about_a_dozen_lines():
    found = examples()
    assert len(found) == 2
    assert "SAETrainer" in found[0] and "optimizer.step()" in found[1]
    assert all(len([line for line in code.splitlines() if line.strip()]) <= 20 for code in found)


@pytest.mark.parametrize("which", [0, 1], ids=["saelens", "pytorch"])
def test_training_example_runs(which, extracted_job, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    if which == 0:
        pytest.importorskip("sae_lens")
    monkeypatch.chdir(tmp_path)  # the PyTorch example writes checkpoint.pt
    code = adapted(examples()[which], str(extracted_job.queue), extracted_job.layer, steps=20)
    namespace: dict = {"__name__": "training_example"}
    exec(compile(code, f"{DOC}:example{which}", "exec"), namespace)  # the doc's own code, nothing else
    loader = namespace["loader"]
    assert loader.hidden_size == extracted_job.hidden
    if which == 1:
        import torch

        saved = torch.load(pathlib.Path("checkpoint.pt"), weights_only=True)
        assert saved["loader"]["format"] == "activations-loader/v1"
        assert math.isfinite(namespace["loss"].item())
