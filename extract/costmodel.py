"""What an extraction job will compute and write, worked out before it runs: tokens, FLOPs, output bytes.

Every figure follows from the job file, the model's `config.json` and the data, by formulas written out here:

- **FLOPs** per sample of `n` tokens, to the deepest layer the job's outputs need, counted as `Engine.flops_per_token`
  counts them (docs/MODEL.md, "Tokens, FLOPs and MFU"): `n * flops_per_token(n)` with, per computed layer,
  projections `2 (D·N·H + 2·D·K·H + N·H·D + 3·D·F)` and attention `4·N·H·n`. Over many samples that is
  `depth * (P * sum(n) + 4·N·H * sum(n²))`, so a job needs the sum of lengths and the sum of squared lengths.
- **Tokens**: rows from parquet footers (or the task manifests, or given), times the tokens per row measured by
  tokenising a sample of rows with the checkpoint's tokenizer exactly as the consumer does (truncated to
  `max_seq_len`). Without a sample, a given mean tokens-per-row is used for both sums (sum(n²) = rows · mean²,
  which undercounts attention when lengths vary; the planner says so).
- **Output bytes** (docs/EXTRACTION.md, "Output shards"): per token, the sum of the outputs' widths (`hidden` per
  hidden state and hook site, `intermediate` for `mlp_hidden`) times the dtype's bytes, plus a 4-byte token id; per sample an 8-byte sample id and an 8-byte offset; per shard one more offset and the
  safetensors header (JSON metadata that repeats the job and the task manifest: estimated, see
  `shard_header_bytes`).
- **Sampling** (`token_sample`, `drop_first`; activations.sampling): the forward pass runs on every token, storage
  holds `token_sample · max(0, n - drop_first)` of a row's `n` tokens on average, plus a 4-byte position each
  (`stored_tokens_per_row`); a document keeps at least one token with probability `1 - (1 - token_sample)^(n -
  drop_first)` (`documents_covered`). `suggest_token_sample` finds the largest fraction whose output fits a budget.
- **Shards**: cut at every `shard_size` rows of a task, and before a row whose tokens would take the shard's
  tensors past `shard_bytes` (at the mean tokens per row, `rows_per_shard`), as the writer cuts them.

Nothing here imports JAX or the cloud glue; `tools/plan.py` joins these figures to prices (reporting/pricing.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from activations.sampling import TokenSampling
from extract.batching import shard_token_limit
from activations.format import Output
from extract.config import ModelConfig
from extract.errors import BadInput
from extract.job import Job, Task

#: Bytes per stored activation value, by the job's `dtype`. fp16 is no smaller than bf16.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
#: fp8 layers also store a float32 scale per token (activations.format.quantize_per_token).
FP8_SCALE_BYTES = 4
TOKEN_ID_BYTES = 4  # token_ids: int32
SAMPLE_ID_BYTES = 8  # sample_ids: int64
OFFSET_BYTES = 8  # offsets: int64, n_samples + 1 per shard
POSITION_BYTES = 4  # positions: int32, per stored token of a sampled job's shard
#: The shard metadata's fixed part (format, model, layers, tokenization, tensor entries, ...) without the job and
#: the task manifest, which are added at their real JSON length. Measured on `make run` shards: 931-947 bytes
#: besides those two (a longer model path adds its length); rounded up.
SHARD_HEADER_FIXED_BYTES = 1024

#: config.json of a few Hub checkpoints, so a job on them can be planned without the Hub. The engine never uses
#: these (it always reads the checkpoint); they only size the plan. Transcribed from the checkpoints' config.json
#: (the fields that size the model; the rest take the family's defaults).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
    },
    "Qwen/Qwen2.5-1.5B": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
    },
    "Qwen/Qwen2.5-7B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    },
    "Qwen/Qwen2.5-14B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    },
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False,
    },
    "meta-llama/Llama-3.1-8B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    },
    "mistralai/Mistral-7B-v0.1": {
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 10000.0,
        "sliding_window": 4096, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    },
    "google/gemma-2-2b": {
        "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "sliding_window": 4096, "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    },
    "google/gemma-2-9b": {
        "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "sliding_window": 4096, "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    },
    "google/gemma-3-1b-pt": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    },
}  # fmt: skip


def computed_layers(layers: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    """The job's hidden-state indices as the engine normalises them: sorted, unique, non-negative.

    Index `i` needs `i` decoder layers (the final-norm index `num_hidden_layers` needs all of them), so the
    deepest index is the number of layers computed. Same rule and range as `extract.engine.normalize_layers`.
    """
    count = num_hidden_layers + 1
    normalized = set()
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int) or not -count <= index < count:
            raise BadInput(
                f"layers: index {index!r} is out of range for a model with num_hidden_layers={num_hidden_layers}: "
                f"use 0..{num_hidden_layers} or -{count}..-1"
            )
        normalized.add(index % count)
    if not normalized:
        raise BadInput("layers is empty: request at least one hidden-state index")
    return tuple(sorted(normalized))


def job_outputs(job: Job, config: ModelConfig) -> tuple[Output, ...]:
    """What the job stores: its hidden-state indices (as `computed_layers` normalises them), then its hook points."""
    layers = computed_layers(job.layers, config.num_hidden_layers) if job.layers else ()
    return (*layers, *config.hook_points(job.sites))


def output_widths(config: ModelConfig, outputs: Sequence[Output]) -> tuple[int, ...]:
    """Each stored output's values per token (`hidden_size`, or `intermediate_size` for `mlp_hidden`)."""
    return tuple(config.width(output) for output in outputs)


def projection_flops_per_token(config: ModelConfig, layer: int = 0) -> int:
    """Matmul FLOPs of decoder layer `layer`'s projections for one token (2 per multiply-add): q, k, v, o and the
    MLP weights the token multiplies with (its family's planning figure, `Family.mlp_weights`)."""
    d, n, k, h = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return 2 * (d * n * h + 2 * d * k * h + n * h * d + config.family.mlp_weights(config, layer))


def stack_projection_flops_per_token(config: ModelConfig, depth: int) -> int:
    """`projection_flops_per_token` summed over the first `depth` decoder layers."""
    return sum(projection_flops_per_token(config, layer) for layer in range(depth))


def attention_flops_per_token_per_key(config: ModelConfig) -> int:
    """One decoder layer's score and weighted-sum FLOPs for one query token against one key."""
    return 4 * config.num_attention_heads * config.head_dim


def flops_per_token(config: ModelConfig, depth: int, seq_len: int) -> float:
    """Forward FLOPs per token of a `seq_len`-token sample through `depth` decoder layers (Engine's count)."""
    attention = depth * attention_flops_per_token_per_key(config) * seq_len
    return float(stack_projection_flops_per_token(config, depth) + attention)


@dataclasses.dataclass(frozen=True)
class TokenEstimate:
    """How many tokens a job stores: rows, and the per-row mean of n and n² (n = stored tokens of a row)."""

    rows: int
    tokens_per_row: float
    tokens_sq_per_row: float
    source: str  # how the per-row figures were obtained, for the plan's reader
    sampled_rows: int = 0  # rows tokenised (0 when the figures were given)
    sample_lengths: tuple[int, ...] = ()  # their stored lengths, to re-estimate at a lower max_seq_len

    @property
    def tokens(self) -> float:
        return self.rows * self.tokens_per_row

    @property
    def tokens_sq(self) -> float:
        return self.rows * self.tokens_sq_per_row

    @classmethod
    def from_lengths(cls, rows: int, lengths: Sequence[int], source: str) -> TokenEstimate:
        if not lengths:
            raise BadInput("token sample: no rows were read; the data files hold no rows")
        return cls(
            rows=rows,
            tokens_per_row=sum(lengths) / len(lengths),
            tokens_sq_per_row=sum(n * n for n in lengths) / len(lengths),
            source=source,
            sampled_rows=len(lengths),
            sample_lengths=tuple(lengths),
        )

    @classmethod
    def from_mean(cls, rows: int, tokens_per_row: float, max_seq_len: int, source: str) -> TokenEstimate:
        """A given mean, capped at max_seq_len (no row stores more); every row is taken to be that long."""
        if rows < 0 or not tokens_per_row >= 0:
            raise BadInput(f"rows={rows}, tokens_per_row={tokens_per_row}: use numbers >= 0")
        mean = min(float(tokens_per_row), float(max_seq_len))
        return cls(rows=rows, tokens_per_row=mean, tokens_sq_per_row=mean * mean, source=source)

    def truncated(self, max_seq_len: int) -> TokenEstimate | None:
        """The estimate had rows been cut at a smaller max_seq_len; None without a sample of lengths."""
        if not self.sample_lengths:
            return None
        return TokenEstimate.from_lengths(
            self.rows, [min(n, max_seq_len) for n in self.sample_lengths], f"{self.source}, cut at {max_seq_len}"
        )


def job_flops(config: ModelConfig, depth: int, tokens: TokenEstimate) -> float:
    """Total forward FLOPs of the job: P · sum n + depth · A · sum n² (P the layers' projections summed), the
    engine's per-sample count summed."""
    return (
        stack_projection_flops_per_token(config, depth) * tokens.tokens
        + depth * attention_flops_per_token_per_key(config) * tokens.tokens_sq
    )


def value_bytes_per_token(job: Job, widths: Sequence[int]) -> int:
    """Activation bytes per stored token: each output's `widths` values (`output_widths`) in the output dtype, and
    for fp8 a float32 scale per output."""
    return sum(widths) * DTYPE_BYTES[job.dtype] + (FP8_SCALE_BYTES * len(widths) if job.dtype == "fp8" else 0)


def bytes_per_token(job: Job, widths: Sequence[int]) -> int:
    """All bytes a stored token costs: its activations plus its int32 token id."""
    return value_bytes_per_token(job, widths) + TOKEN_ID_BYTES


def shard_header_bytes(job: Job, task: Task | None = None) -> int:
    """Estimated safetensors header of one shard: a fixed part plus the job's and the task manifest's JSON."""
    task_json = len(json.dumps(task.to_dict())) if task is not None else 256
    return SHARD_HEADER_FIXED_BYTES + len(json.dumps(job.to_dict())) + task_json


@dataclasses.dataclass(frozen=True)
class OutputEstimate:
    bytes_per_token: int
    token_bytes: float  # activations and token ids
    sample_bytes: float  # sample ids and offsets
    shards: int
    header_bytes: float  # headers and the per-shard extra offset
    stored_tokens_per_row: float = 0.0  # after the job's sampling (every token without one)

    @property
    def total(self) -> float:
        return self.token_bytes + self.sample_bytes + self.header_bytes


def rows_per_shard(job: Job, tokens_per_row: float, per_token: int) -> int:
    """Rows a full shard holds: `shard_size`, or fewer where their tokens would take its tensors past `shard_bytes`
    (the writer's byte cut, `extract.batching.ShardBounds`), at the mean tokens per row. `per_token` is
    `bytes_per_token`, the figure the consumer turns `shard_bytes` into a token limit with."""
    token_limit = shard_token_limit(job.shard_bytes, per_token)
    if token_limit is None or tokens_per_row <= 0:
        return job.shard_size
    return max(1, min(job.shard_size, int(token_limit // tokens_per_row)))


def shards_in_task(rows: int, shard_size: int, shard_rows: int | None = None) -> int:
    """Shards a task of `rows` rows writes. They are cut at every multiple of shard_size within the task, and each
    such block is cut again every `shard_rows` rows (the byte cut, see `rows_per_shard`; default: no byte cut)."""
    shard_rows = min(shard_rows or shard_size, shard_size)
    full, rest = divmod(rows, shard_size)
    return full * -(-shard_size // shard_rows) + -(-rest // shard_rows)


def output_bytes(
    job: Job, widths: Sequence[int], tokens: TokenEstimate, task_rows: Sequence[int], header_bytes: int
) -> OutputEstimate:
    """Bytes the job writes, given its outputs' widths (`output_widths`) and the rows of each of its tasks (their sum
    is `tokens.rows`); a sampled job's stored tokens only (`stored_tokens_per_row`), each with its position."""
    per_token = bytes_per_token(job, widths) + (POSITION_BYTES if job.sampling.active else 0)
    stored = stored_tokens_per_row(tokens, job.sampling)
    shard_rows = rows_per_shard(job, stored, per_token)
    shards = sum(shards_in_task(rows, job.shard_size, shard_rows) for rows in task_rows)
    return OutputEstimate(
        bytes_per_token=per_token,
        token_bytes=tokens.rows * stored * per_token,
        sample_bytes=tokens.rows * (SAMPLE_ID_BYTES + OFFSET_BYTES),
        shards=shards,
        header_bytes=shards * (header_bytes + OFFSET_BYTES),
        stored_tokens_per_row=stored,
    )


def stored_tokens_per_row(tokens: TokenEstimate, sampling: TokenSampling) -> float:
    """Mean tokens stored per row: every token, or a sampled job's expected share of each sampled length."""
    if not sampling.active:
        return tokens.tokens_per_row
    if tokens.sample_lengths:
        return sum(sampling.expected_kept(n) for n in tokens.sample_lengths) / len(tokens.sample_lengths)
    return sampling.expected_kept(tokens.tokens_per_row)


def documents_covered(tokens: TokenEstimate, sampling: TokenSampling) -> float:
    """The share of rows that store at least one token: over the sampled lengths, else at the mean length."""
    lengths = tokens.sample_lengths or (tokens.tokens_per_row,)
    return sum(sampling.covered(n) for n in lengths) / len(lengths)


def suggest_token_sample(
    budget_bytes: float, job: Job, widths: Sequence[int], tokens: TokenEstimate, task_rows: Sequence[int],
    header_bytes: int,
) -> float | None:  # fmt: skip
    """The largest token_sample, rounded down to two significant digits, whose output fits `budget_bytes` (the
    job's drop_first and seed kept); None if even the smallest fraction, 0.0001, does not fit (the per-row and
    per-shard bytes alone exceed it). Bisection over `output_bytes`, which grows with the fraction."""

    def total(fraction: float) -> float:
        sampled = job.model_copy(update={"token_sample": fraction})
        return output_bytes(sampled, widths, tokens, task_rows, header_bytes).total

    low, high = 1e-4, 1.0
    if total(low) > budget_bytes:
        return None
    if total(high) <= budget_bytes:
        return 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if total(middle) <= budget_bytes else (low, middle)
    digits = -math.floor(math.log10(low)) + 1
    return max(1e-4, math.floor(low * 10**digits) / 10**digits)


def split_rows(rows: int, rows_per_task: int) -> list[int]:
    """The row counts of the tasks `plan_tasks` cuts `rows` rows into: all full but the last."""
    full, rest = divmod(rows, rows_per_task)
    return [rows_per_task] * full + ([rest] if rest else [])


def rows_per_task_for(
    target_seconds: float, seconds_per_row: float, shard_size: int, at_most: int | None = None
) -> int:
    """Rows per task so that a task runs about `target_seconds`: whole shards when a task holds one or more.

    A task of whole shards never writes a short shard before its last one; below one shard the count is
    rounded down to two significant digits. Never below 1, and never above `at_most` (the job's rows).
    """
    if seconds_per_row <= 0:
        raise ValueError(f"seconds_per_row={seconds_per_row} must be positive")
    rows = target_seconds / seconds_per_row
    if rows >= shard_size:
        chosen = int(rows // shard_size) * shard_size
    else:
        digits = max(0, int(math.floor(math.log10(max(rows, 1)))) - 1)
        chosen = int(rows // 10**digits) * 10**digits
    chosen = max(1, chosen)
    return min(chosen, at_most) if at_most else chosen


def sample_token_lengths(
    files: Sequence[tuple[str, int]],
    text_field: str,
    encode: Callable[[list[str]], list[Any]],
    max_rows: int,
    max_files: int = 8,
) -> list[int]:
    """Stored lengths of up to `max_rows` rows: the first rows of up to `max_files` files spread over the list.

    Reads through `extract.data.read_slice` (only the text column, only the row groups needed), so a gs:// or
    hf:// file costs a few ranged reads; `encode` is the consumer's tokenisation (truncating to max_seq_len).
    """
    from extract.data import read_slice  # pyarrow and the store clients load only when a sample is taken
    from extract.job import FileSlice

    nonempty = [(path, count) for path, count in files if count > 0]
    if not nonempty or max_rows <= 0:
        return []
    step = max(1, len(nonempty) // max_files)
    chosen = nonempty[::step][:max_files]
    per_file = max(1, max_rows // len(chosen))
    lengths: list[int] = []
    for path, count in chosen:
        task = Task(id="sample", files=(FileSlice(path=path, base=0, start=0, end=min(per_file, count)),))
        texts = [doc.text for doc in read_slice(task, text_field)]
        lengths.extend(len(ids) for ids in encode(texts))
    return lengths


def model_config(
    job: Job, config_file: str | None = None, workdir: pathlib.Path | None = None
) -> tuple[ModelConfig, str, pathlib.Path | None]:
    """The job model's architecture: (config, where it came from, a local directory with its tokenizer, or None).

    From `config_file` if given; else from the model's directory if it is local; else, for a gs:// model, from its
    config.json and tokenizer files fetched into `workdir` (never the weights); else from `KNOWN_CONFIGS`.
    A Hub model is never downloaded for a plan.
    """
    local = pathlib.Path(job.model).expanduser()
    model_dir = local if local.is_dir() else None
    if job.model.startswith("gs://") and workdir is not None:
        model_dir = fetch_model_metadata(job.model, workdir)
    if config_file:
        return ModelConfig.from_file(pathlib.Path(config_file)), str(config_file), model_dir
    if model_dir is not None:
        source = f"{job.model.rstrip('/')}/config.json" if job.model.startswith("gs://") else str(local / "config.json")
        return ModelConfig.from_file(model_dir / "config.json"), source, model_dir
    if job.model in KNOWN_CONFIGS:
        config = ModelConfig.from_dict(KNOWN_CONFIGS[job.model], source=f"built-in {job.model}")
        return config, f"built-in copy of {job.model}'s config.json (extract/costmodel.py)", None
    raise BadInput(
        f"model: {job.model!r} is not a local or gs:// directory and has no built-in config; pass the "
        "checkpoint's config.json (--model-config)"
    )


def _is_model_metadata(name: str) -> bool:
    """config.json and tokenizer files (tokenizer.json, vocab.json, merges.txt, ...), not weights or their index."""
    return "/" not in name and name.endswith((".json", ".txt", ".model")) and not name.endswith(".index.json")


def fetch_model_metadata(url: str, directory: pathlib.Path) -> pathlib.Path:
    """Copy a gs:// model directory's config.json and tokenizer files into `directory`; return it.

    A few small reads: the weights (`*.safetensors`) are never fetched, so planning a 7B job costs kilobytes.
    """
    import objectstore
    from extract.errors import TransientIOError

    store = objectstore.open_store(url)
    try:
        names = [e.name for e in store.list("") if _is_model_metadata(e.name)]
        if "config.json" not in names:
            raise BadInput(f"model: {url!r} holds no config.json; mirror the checkpoint with gcs-spawner mirror")
        directory.mkdir(parents=True, exist_ok=True)
        for name in names:
            (directory / name).write_bytes(store.read(name).data)
    except objectstore.StoreError as exc:
        raise TransientIOError(f"model: reading {url!r} failed: {exc}") from exc
    return directory


def measure_tokens(
    job: Job, files: Sequence[tuple[str, int]], rows: int, tokenizer_dir: str | pathlib.Path, sample_rows: int
) -> TokenEstimate:
    """Tokens of a job of `rows` rows, per row measured on a sample of `files` with the checkpoint's tokenizer."""
    from extract.batching import Tokenizer  # transformers loads only when a sample is taken

    tokenizer = Tokenizer(tokenizer_dir, job.max_seq_len)
    lengths = sample_token_lengths(files, job.text_field, tokenizer.encode, sample_rows)
    return TokenEstimate.from_lengths(
        rows, lengths, f"{len(lengths)} rows tokenised with {tokenizer_dir} (max_seq_len {job.max_seq_len})"
    )


def seconds_per_row(config: ModelConfig, depth: int, tokens: TokenEstimate, flops_per_second: float) -> float:
    """Mean seconds one row takes at a sustained `flops_per_second` (peak x MFU)."""
    if not tokens.rows:
        return 0.0
    return job_flops(config, depth, tokens) / tokens.rows / flops_per_second


def recommend_rows_per_task(
    config: ModelConfig, depth: int, tokens: TokenEstimate, flops_per_second: float, target_seconds: float,
    shard_size: int, fixed_seconds: float = 0.0,
) -> int:
    """--rows-per-task for tasks of about `target_seconds` at `flops_per_second`, or longer where a task's
    `fixed_seconds` would otherwise exceed FIXED_SHARE of its machine time; all rows if the job is shorter.

    About ten minutes bounds the work a preemption loses (a task resumes from its last committed shard, but the
    open shard is lost) while keeping the per-task requests (claim, done marker, tombstone) a small share.
    """
    per_row = seconds_per_row(config, depth, tokens, flops_per_second)
    if per_row <= 0:
        return max(1, tokens.rows)
    floor = min_task_seconds(fixed_seconds)
    chosen = rows_per_task_for(max(target_seconds, floor), per_row, shard_size, at_most=tokens.rows)
    if chosen * per_row < floor and chosen < tokens.rows:  # rounded down below the floor: the next whole shard
        chosen = min(tokens.rows, chosen + shard_size if chosen >= shard_size else math.ceil(floor / per_row))
    return chosen


# -- a task's fixed seconds ----------------------------------------------------------------------------------------
# Every task pays to start and stop (extract/phases.py: every phase but the steady state), whatever its size. The
# planner sizes tasks so that this stays under FIXED_SHARE of the machine's time. The figures per platform are a
# formula over what the job loads and compiles, with coefficients that are measured where a machine measured them
# (bench/goodput_bench.py) and labelled assumptions where none has yet.

#: The largest share of a task's machine time its fixed seconds may take.
FIXED_SHARE = 0.02


@dataclasses.dataclass(frozen=True)
class StartupCost:
    """A task's fixed seconds on one platform: `base_s` (imports, devices, tokenizer and first batch, first step,
    write tail), weights at `weights_bytes_per_s` from the machine's copy to the devices, and per program
    `trace_s_per_layer` x layers of tracing plus `load_s` to load it from the compilation cache. A machine's first
    task adds the copy of the checkpoint from the bucket (`bucket_bytes_per_s`) and XLA's compile
    (`compile_s_per_layer` x layers a program) unless the shared cache holds it."""

    base_s: float
    weights_bytes_per_s: float
    trace_s_per_layer: float
    load_s: float
    bucket_bytes_per_s: float
    compile_s_per_layer: float
    source: str  # "measured: ..." or "assumed: ..."

    @property
    def assumed(self) -> bool:
        return self.source.startswith("assumed")


#: By platform (the `--accelerator`'s: TPU or GPU; cpu for a CPU machine).
STARTUP_COSTS = {
    "tpu": StartupCost(
        base_s=20.0, weights_bytes_per_s=1.5e9, trace_s_per_layer=0.1, load_s=2.0, bucket_bytes_per_s=0.8e9,
        compile_s_per_layer=3.0,
        source="assumed: no TPU has measured a task's phases yet (bench/goodput_bench.py, bench/accelerator_run.sh)",
    ),
    "gpu": StartupCost(
        base_s=20.0, weights_bytes_per_s=1.5e9, trace_s_per_layer=0.1, load_s=2.0, bucket_bytes_per_s=0.8e9,
        compile_s_per_layer=2.0,
        source="assumed: no GPU has measured a task's phases yet (bench/accelerator_run.sh measures them on an H100)",
    ),
    # The Qwen2.5-0.5B shape at 4 layers, warm task 2 and the cold task of docs/PERFORMANCE.md's unpacked run:
    # imports, prepare, first step and tail 10.6 s; 0.39 GB placed in 1.84 s; trace 0.25 s and load 0.12 s for one
    # 4-layer program; 0.99 GB copied in 21.4 s; 2.84 s of XLA compile.
    "cpu": StartupCost(
        base_s=10.6, weights_bytes_per_s=0.2e9, trace_s_per_layer=0.06, load_s=0.12, bucket_bytes_per_s=0.05e9,
        compile_s_per_layer=0.7,
        source="measured: bench/goodput_bench.py on a loaded 2-core CPU machine (docs/PERFORMANCE.md, Goodput)",
    ),
}


def task_fixed_seconds(
    startup: StartupCost, config: ModelConfig, depth: int, programs: int, compute_bytes: int = 2
) -> dict[str, Any]:
    """A task's fixed seconds on a machine that has run the job before (`warm_s`) and the extra of its first task
    (`first_task_extra_s`), with the parts they come from."""
    from extract.memory import weight_bytes

    placed = weight_bytes(config, depth, compute_bytes)
    checkpoint = weight_bytes(config, config.num_hidden_layers, compute_bytes)  # the copy holds every layer
    parts = {
        "base_s": startup.base_s,
        "weights_s": placed / startup.weights_bytes_per_s,
        "programs_s": programs * (startup.trace_s_per_layer * depth + startup.load_s),
    }
    extra = {
        "bucket_copy_s": checkpoint / startup.bucket_bytes_per_s,
        "compile_s": programs * startup.compile_s_per_layer * depth,
    }
    return {
        "warm_s": sum(parts.values()),
        "first_task_extra_s": sum(extra.values()),
        "parts": {**parts, **extra},
        "programs": programs,
        "source": startup.source,
        "assumed": startup.assumed,
    }


def min_task_seconds(fixed_seconds: float, share: float = FIXED_SHARE) -> float:
    """The shortest steady state that keeps `fixed_seconds` within `share` of a task's machine time."""
    return fixed_seconds * (1 - share) / share
