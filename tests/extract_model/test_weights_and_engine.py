"""Weight sources (local directory store, gs:// through a real GCS client), compilation bookkeeping, FLOP counts."""

from __future__ import annotations

import http.server
import logging
import os
import socket
import subprocess
import sys
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import objectstore
from extract.engine import Engine
from extract.errors import BadInput
from extract.weights import Checkpoint, fetch_from_store, upload_model_dir
from tests.extract_model.conftest import ragged_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hidden_states(model_dir, layers=(0, 1, -1), **overrides):
    kwargs = dict(batch_size=2, max_seq_len=16, compute_dtype="float32", out_dtype="float32", devices=jax.devices()[:1])
    kwargs.update(overrides)
    engine = Engine(str(model_dir), list(layers), **kwargs)
    tokens, _ = ragged_batch(np.random.default_rng(11), [16, 9])
    return {layer: np.asarray(h) for layer, h in engine.forward(tokens).items()}


def test_local_store_mirror_round_trip_loads_the_same_model(qwen2_untied, tmp_path):
    dest = tmp_path / "bucket" / "models" / "tiny"
    names = upload_model_dir(qwen2_untied.path, str(dest))
    assert names[-1] == "config.json", "config.json must be written last"
    assert {n for n in names if n.endswith(".safetensors")} == {p.name for p in qwen2_untied.path.glob("*.safetensors")}

    cache = tmp_path / "cache"
    fetched = fetch_from_store(str(dest), cache)
    original = hidden_states(qwen2_untied.path)
    for layer, array in hidden_states(fetched).items():
        np.testing.assert_array_equal(array, original[layer])


def test_second_fetch_reuses_the_cache_and_a_changed_file_is_fetched_again(qwen2_untied, tmp_path):
    dest = tmp_path / "mirror"
    upload_model_dir(qwen2_untied.path, str(dest))
    cache = tmp_path / "cache"
    fetch_from_store(str(dest), cache)
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if not p.name.startswith(".")}
    fetch_from_store(str(dest), cache)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if not p.name.startswith(".")} == before

    objectstore.open_store(str(dest)).put("generation_config.json", b'{"changed": true}')
    fetch_from_store(str(dest), cache)
    assert (cache / "generation_config.json").read_bytes() == b'{"changed": true}'
    assert (cache / "config.json").stat().st_mtime_ns == before["config.json"]


def test_prefix_without_config_json_is_not_a_model(qwen2_untied, tmp_path):
    store = objectstore.open_store(str(tmp_path / "half"))
    shard = sorted(qwen2_untied.path.glob("*.safetensors"))[0]
    store.put(shard.name, shard.read_bytes())  # an interrupted mirror: config.json comes last
    with pytest.raises(BadInput, match="no config.json"):
        fetch_from_store(str(tmp_path / "half"), tmp_path / "cache")


def test_mirror_tool_uploads_to_gcs_and_engine_loads_from_gs_url(qwen3, gcs_client, gcs_bucket, tmp_path, monkeypatch):
    url = f"gs://{gcs_bucket}/models/tiny-qwen3"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "mirror_model.py"), str(qwen3.path), url],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "config.json" in result.stdout
    listed = {blob.name for blob in gcs_client.list_blobs(gcs_bucket, prefix="models/tiny-qwen3/")}
    assert "models/tiny-qwen3/config.json" in listed

    monkeypatch.setenv("EXTRACT_MODEL_CACHE", str(tmp_path / "cache"))
    from_bucket = hidden_states(url)
    assert (tmp_path / "cache" / gcs_bucket / "models" / "tiny-qwen3" / "config.json").is_file()
    for layer, array in hidden_states(qwen3.path).items():
        np.testing.assert_array_equal(from_bucket[layer], array)


def test_mirror_tool_refuses_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "mirror_model.py"), str(tmp_path / "empty"), "gs://a-bucket/models/d"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 65
    assert "config.json" in result.stderr


class _NoSuchRepoHub(http.server.BaseHTTPRequestHandler):
    """Answers every hub API call the way the hub answers for a repository that does not exist."""

    def do_GET(self):
        body = b'{"error": "Repository not found"}'
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def resolve_in_subprocess(endpoint: str, tmp_path) -> str:
    """huggingface_hub reads HF_ENDPOINT at import, so the lookup runs in a fresh interpreter."""
    code = (
        "from extract.weights import resolve_model_dir\n"
        "try:\n    resolve_model_dir('Qwen/NoSuchModel')\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    return result.stdout


def test_hub_id_that_does_not_exist_is_bad_input(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepoHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = resolve_in_subprocess(f"http://127.0.0.1:{server.server_port}", tmp_path)
    finally:
        server.shutdown()
    assert out.startswith("BadInput model='Qwen/NoSuchModel'"), out


def test_unreachable_hub_is_transient(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = resolve_in_subprocess(f"http://127.0.0.1:{port}", tmp_path)
    assert out.startswith("TransientIOError model='Qwen/NoSuchModel'"), out


def test_bfloat16_checkpoint_loads_into_float32_compute(qwen2_tied, tmp_path):
    """Qwen ships bf16 safetensors, which numpy cannot represent; the loader reads them through ml_dtypes."""
    source = Checkpoint(qwen2_tied.path)
    target = tmp_path / "bf16"
    target.mkdir()
    (target / "config.json").write_bytes((qwen2_tied.path / "config.json").read_bytes())
    save_file(
        {name: np.asarray(source.read(name)).astype(ml_dtypes.bfloat16) for name in source.tensors},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )
    assert {t.dtype for t in Checkpoint(target).tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    hidden = hidden_states(target, layers=(0,))
    rounded = np.asarray(source.read("model.embed_tokens.weight")).astype(ml_dtypes.bfloat16).astype(np.float32)
    tokens, _ = ragged_batch(np.random.default_rng(11), [16, 9])
    np.testing.assert_array_equal(hidden[0], rounded[tokens])


def test_one_program_per_sequence_length_each_logged_once(qwen2_untied, caplog):
    engine = Engine(
        str(qwen2_untied.path), [1], batch_size=2, max_seq_len=32, compute_dtype="float32", devices=jax.devices()[:1]
    )
    assert engine.compiled_programs == 0
    with caplog.at_level(logging.INFO, logger="extract.engine"):
        for seq_len in (8, 16, 8, 16, 32):
            out = engine.forward(np.ones((2, seq_len), np.int32))
            assert out[1].shape == (2, seq_len, engine.config.hidden_size)
            assert out[1].dtype == jax.numpy.bfloat16  # the default out_dtype
    assert engine.compiled_programs == 3
    compiles = [r.getMessage() for r in caplog.records if "event=compile " in r.getMessage()]
    assert [m.split("seq_len=")[1].split()[0] for m in compiles] == ["8", "16", "32"]


def test_longer_than_max_seq_len_is_refused(qwen2_untied):
    engine = Engine(str(qwen2_untied.path), [1], batch_size=2, max_seq_len=8, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="max_seq_len=8"):
        engine.forward(np.ones((2, 9), np.int32))


def test_flops_per_token_counts_the_weight_matrices_of_computed_layers_only(qwen3):
    checkpoint = Checkpoint(qwen3.path)
    config_layers = qwen3.num_hidden_layers
    seq_len = 64
    for deepest in (1, config_layers):
        engine = Engine(str(qwen3.path), [deepest], batch_size=1, max_seq_len=seq_len, devices=jax.devices()[:1])
        # Independent count: 2 FLOPs per weight-matrix entry of each computed layer, read from the checkpoint,
        # plus scores and weighted sum over seq_len keys for every query head.
        matrices = sum(
            int(np.prod(loc.shape))
            for name, loc in checkpoint.tensors.items()
            if name.endswith("_proj.weight") and int(name.split(".")[2]) < deepest
        )
        attention = deepest * 2 * 2 * engine.config.num_attention_heads * engine.config.head_dim * seq_len
        assert engine.flops_per_token(seq_len) == pytest.approx(2 * matrices + attention)
        assert engine.peak_flops() is None  # CPU: no meaningful peak, so no MFU


def test_random_weight_engine_runs_sharded_on_a_2x2_mesh(qwen3):
    """The accelerator benchmark's path: weights drawn on the devices, already on their shardings."""
    from extract.config import ModelConfig

    config = ModelConfig.from_file(qwen3.path / "config.json")
    engine = Engine.with_random_weights(
        config, [0, -1], batch_size=4, max_seq_len=16, compute_dtype="float32", mesh="data=2,model=2",
        devices=jax.devices()[:4],
    )  # fmt: skip
    assert (engine.model_dir / "config.json").is_file()
    assert ModelConfig.from_file(engine.model_dir / "config.json") == config
    hidden = engine.forward(np.ones((4, 16), np.int32))
    assert set(hidden) == {0, config.num_hidden_layers}
    final = np.asarray(hidden[config.num_hidden_layers], dtype=np.float32)
    assert np.isfinite(final).all() and final.std() > 0


#: Loads a hub model in a fresh interpreter (huggingface_hub reads HF_ENDPOINT at import) and prints what happened.
_LOAD_FROM_HUB = """
import sys
from extract.engine import Engine
from extract.errors import BadInput
from extract.weights import mirror_hub_snapshot
try:
    engine = Engine(sys.argv[1], [0, -1], batch_size=1, max_seq_len=8, compute_dtype="float32")
    print("loaded", engine.config.model_type, engine.forward([[1, 2, 3]])[0].shape)
except BadInput as exc:
    print("BadInput", exc)
try:
    print("mirrored", mirror_hub_snapshot(sys.argv[1], sys.argv[2]))
except BadInput as exc:
    print("BadInput mirror", exc)
"""


def load_from_hub(hub, repo: str, tmp_path) -> str:
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_XET="1", JAX_PLATFORMS="cpu")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", _LOAD_FROM_HUB, repo, str(tmp_path / "bucket" / repo)], env=env,
                            capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_hub_model_of_an_unsupported_family_downloads_nothing_but_config_json(qwen2_untied, tmp_path):
    """config.json is fetched and read first, by the engine and by the mirror tool: a DeepSeek-V3's weights (hundreds
    of GB on the real hub; its multi-head latent attention is not supported) are never requested. A supported model from the same hub still downloads whole, loads and
    mirrors."""
    from tests.extract_model.fakehub import FakeHub

    mixtral = tmp_path / "deepseek"
    mixtral.mkdir()
    (mixtral / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2}')
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (mixtral / shard).write_bytes(b"\0" * 2**20)
    (mixtral / "tokenizer.json").write_text("{}")
    with FakeHub({"acme/mixtral": mixtral, "acme/tiny": qwen2_untied.path}) as hub:
        out = load_from_hub(hub, "acme/mixtral", tmp_path)
        assert out.startswith("BadInput") and "model_type='deepseek_v3' is not supported" in out, out
        assert "BadInput mirror" in out and not (tmp_path / "bucket" / "acme/mixtral").exists(), out
        assert set(hub.downloads("acme/mixtral")) == {"config.json"}, hub.requests
        out = load_from_hub(hub, "acme/tiny", tmp_path)
        assert out.startswith("loaded qwen2 (1, 3, 64)") and "mirrored" in out, out
        weights = {p.name for p in qwen2_untied.path.glob("*.safetensors")}
        assert weights and weights <= set(hub.downloads("acme/tiny"))
        assert weights <= {p.name for p in (tmp_path / "bucket" / "acme/tiny").iterdir()}
