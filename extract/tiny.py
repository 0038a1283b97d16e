"""Tiny, generated-on-the-spot stand-ins for a Qwen checkpoint and for FineWeb-Edu parquet files.

Tests and the demo (`make run`) cannot reach the Hugging Face Hub, so they build what they need
here: a checkpoint in the exact Hugging Face layout (config.json, model.safetensors under the HF
tensor names, tokenizer.json + tokenizer_config.json), with random weights drawn by numpy and a
byte-level BPE tokenizer trained in a second on generated text; and parquet files with
FineWeb-Edu's columns. Everything is deterministic in `seed`.
"""

from __future__ import annotations

import json
import pathlib
import random
from collections.abc import Iterator

import numpy as np

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# Enough distinct words that a few-hundred-token BPE learns real merges; a few non-ASCII ones
# make sure multi-byte characters go through the byte-level path.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will no more if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since against go "
    "came right used take three school students learning teachers education science history water energy health "
    "research climate children language mathematics cells planet river forest computer reading writing café naïve "
    "über Straße 学习 数据 東京"
).split()


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    words[0] = words[0].capitalize()
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randrange(1, 2100)))
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!"))


def generate_text(rng: random.Random, n_words: int) -> str:
    """Sentence-shaped filler of about `n_words` words, with paragraph breaks."""
    parts: list[str] = []
    remaining = n_words
    while remaining > 0:
        k = min(remaining, rng.randint(4, 18))
        parts.append(_sentence(rng, k))
        remaining -= k
        if rng.random() < 0.15:
            parts.append("\n\n")
    return " ".join(parts).replace(" \n\n ", "\n\n").strip()


def _training_corpus(seed: int, n_docs: int = 400) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n_docs):
        yield generate_text(rng, rng.randint(20, 120))


def write_tiny_tokenizer(
    directory: str | pathlib.Path, vocab: int, seed: int = 0, model_max_length: int = 4096
) -> None:
    """A byte-level BPE like Qwen's (no BOS, `<|endoftext|>` as EOS and pad), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed), trainer)
    if tokenizer.get_vocab_size() > vocab:
        raise ValueError(f"vocab={vocab} is too small for a byte-level tokenizer: use at least 300")
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": model_max_length,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def tiny_qwen_config(
    model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, tie: bool, intermediate: int
) -> dict:
    """config.json as Qwen's own checkpoints spell it (top-level rope_theta, torch_dtype)."""
    if model_type not in ("qwen2", "qwen3"):
        raise ValueError(f"model_type={model_type!r}: use 'qwen2' or 'qwen3'")
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}: hidden must divide by heads, heads by kv_heads"
        )
    config = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "Qwen3ForCausalLM"],
        "model_type": model_type,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,  # <|endoftext|> is the first special token, id 0
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 4096,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    if model_type == "qwen3":
        config["head_dim"] = hidden // heads
        config["attention_bias"] = False
    return config


def tiny_qwen_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face tensor names of Qwen2/Qwen3."""
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    qwen3 = config["model_type"] == "qwen3"

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        # Not all ones, so a loader that drops a norm weight is caught by a numerical comparison.
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    def bias(dim: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = dense(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = dense(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = dense(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = dense(hidden, heads * head_dim)
        if qwen3:
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        else:
            weights[p + "self_attn.q_proj.bias"] = bias(heads * head_dim)
            weights[p + "self_attn.k_proj.bias"] = bias(kv_heads * head_dim)
            weights[p + "self_attn.v_proj.bias"] = bias(kv_heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = dense(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = dense(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = dense(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = dense(vocab, hidden)
    return weights


def write_tiny_qwen(
    directory: str | pathlib.Path,
    model_type: str = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 384,
    tie: bool = False,
    seed: int = 0,
    intermediate: int | None = None,
) -> pathlib.Path:
    """Write a loadable Hugging Face Qwen2/Qwen3 checkpoint into `directory`; return the directory."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen_config(model_type, hidden, layers, heads, kv_heads, vocab, tie, intermediate or 2 * hidden)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # transformers refuses safetensors files whose metadata does not name a known format.
    save_file(tiny_qwen_weights(config, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 0, "do_sample": False}, indent=2) + "\n"
    )
    write_tiny_tokenizer(directory, vocab=vocab, seed=seed)
    return directory


#: FineWeb-Edu's columns, in its order.
FINEWEB_COLUMNS = (
    "text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score", "int_score",
)  # fmt: skip


def _fineweb_text(rng: random.Random) -> str:
    """Mixed lengths: empty, short, typical, and documents far longer than any test's max_seq_len."""
    kind = rng.random()
    if kind < 0.06:
        return ""
    if kind < 0.35:
        return generate_text(rng, rng.randint(1, 12))
    if kind < 0.9:
        return generate_text(rng, rng.randint(13, 90))
    return generate_text(rng, rng.randint(400, 900))


def write_fineweb_like_parquet(
    directory: str | pathlib.Path, n_files: int, rows_per_file: int | list[int], seed: int = 0, row_group_size: int = 16
) -> list[pathlib.Path]:
    """Write `n_files` parquet files shaped like FineWeb-Edu's; return their paths in sorted order.

    `rows_per_file` may be a list to give files different lengths. Small row groups make the
    reader's row-group selection matter even for small files.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    counts = rows_per_file if isinstance(rows_per_file, list) else [rows_per_file] * n_files
    if len(counts) != n_files:
        raise ValueError(f"rows_per_file has {len(counts)} entries for n_files={n_files}")
    rng = random.Random(seed)
    schema = pa.schema(
        [
            ("text", pa.string()),
            ("id", pa.string()),
            ("dump", pa.string()),
            ("url", pa.string()),
            ("file_path", pa.string()),
            ("language", pa.string()),
            ("language_score", pa.float64()),
            ("token_count", pa.int64()),
            ("score", pa.float64()),
            ("int_score", pa.int64()),
        ]
    )
    paths = []
    for f, n_rows in enumerate(counts):
        dump = f"CC-MAIN-2024-{10 + f:02d}"
        columns: dict[str, list] = {name: [] for name in FINEWEB_COLUMNS}
        for r in range(n_rows):
            text = _fineweb_text(rng)
            score = round(rng.uniform(2.5, 5.0), 6)
            columns["text"].append(text)
            columns["id"].append(f"<urn:uuid:{rng.getrandbits(128):032x}>")
            columns["dump"].append(dump)
            columns["url"].append(f"https://example.org/{dump}/{f}/{r}.html")
            columns["file_path"].append(f"s3://commoncrawl/crawl-data/{dump}/segments/{f:05d}/warc/{r:05d}.warc.gz")
            columns["language"].append("en")
            columns["language_score"].append(round(rng.uniform(0.65, 1.0), 6))
            columns["token_count"].append(len(text.split()) * 4 // 3)
            columns["score"].append(score)
            columns["int_score"].append(int(round(score)))
        path = directory / f"{f:03d}_00000.parquet"
        pq.write_table(pa.table(columns, schema=schema), path, row_group_size=row_group_size)
        paths.append(path)
    return paths
