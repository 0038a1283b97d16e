"""SAELens: a data provider for its trainer, and its cached-activations layout as an export.

Hook names. A hidden-state index is transformers' (docs/MODEL.md): 0 is the embeddings, i in 1..n-1 the output of
block i counted from 1, n (num_hidden_layers) the final norm's output. TransformerLens counts blocks from 0, so index
i (1 <= i < n) is `blocks.{i-1}.hook_resid_post`, 0 is `blocks.0.hook_resid_pre`, and n is
`ln_final.hook_normalized` (the final norm's output, which no block's resid_post equals). A hook site of decoder
layer l (counted from 0, as TransformerLens's blocks) is `blocks.{l}.<HOOKS[site]>` (docs/EXTRACTION.md, "Hook
sites", says where a value differs from TransformerLens's: `mlp_in` is the norm's output with its weight applied).

Trainer. SAELens trains from any iterator of [batch, d_in] tensors (`SAETrainer(cfg, sae, data_provider=...)`,
sae_lens/training/sae_trainer.py), so the provider is the loader with torch output. SAELens's own
`normalize_activations="expected_average_only_in"` estimates the mean norm from `n_batches_for_norm_estimate`
batches; `ActivationLoader(normalize="mean_norm")` applies the same scaling (sqrt(d_in) / E||x||) from the
statistics the writer stored instead, so configure the SAE with `normalize_activations="none"` then.

Export. `export_cached_activations` writes what `ActivationsStore.load_cached_activation_dataset` reads
(sae_lens/training/activations_store.py, built by sae_lens/cache_activations_runner.py): a Hugging Face `datasets`
directory (`save_to_disk`) with one `Array2D(shape=(context_size, d_in))` column named after the hook and a
`token_ids` column, `Sequence(Value("int32"), length=context_size)`. The job's tokens, in slice order, are cut into
rows of exactly `context_size` (documents concatenated, as SAELens's own cache does; the remainder is dropped).
A sampled job's shards (token_sample, drop_first) export the same way: a row then holds stored tokens of several
documents, not consecutive text; SAELens's cache trains on single tokens and shuffles them, so nothing depends on
a row being contiguous (the summary says `sampled`).

Positions. SAELens's cache has no place for a token's position in its document: `CacheActivationsRunner` writes the
hook's column and `token_ids` only, and `load_cached_activation_dataset` formats just those two columns
(`set_format(columns=[hook_name, "token_ids"])`), so `get_raw_llm_batch` returns (activations, token ids). The
export adds a third column, `positions` (`Sequence(Value("int32"), length=context_size)`, each token's position in
its document: a sampled job's stored positions, else its offset in its document), which SAELens leaves unread and
`datasets.load_from_disk(directory)["positions"]` gives back.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

from activations.format import HIDDEN, SITES
from activations.io import ActivationsError
from activations.loader import ActivationLoader, LoaderConfigError

#: TransformerLens's hook of each site, within `blocks.{l}`.
HOOKS = {
    "resid_pre": "hook_resid_pre",
    "attn_out": "hook_attn_out",
    "resid_mid": "hook_resid_mid",
    "mlp_in": "ln2.hook_normalized",
    "mlp_hidden": "mlp.hook_post",
    "mlp_out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
    # TransformerLens's MoE component (components/mlps/moe.py) names the router's weights hook_expert_weights (its
    # versions keep the top k per token, or, as here, every expert with zeros where not chosen) and has no hook on
    # the router's logits: that one is named as its neighbours are.
    "router_logits": "mlp.hook_router_logits",
    "expert_weights": "mlp.hook_expert_weights",
    # ... and the chosen experts' indices hook_expert_indices ([batch, pos, experts_per_token], heaviest first).
    "expert_indices": "mlp.hook_expert_indices",
}
assert tuple(HOOKS) == SITES


def hook_name(layer: int, num_hidden_layers: int, site: str = HIDDEN) -> str:
    """TransformerLens's hook for hidden-state index `layer`, or for `site` of decoder layer `layer` (see the
    module docstring)."""
    if site != HIDDEN:
        if site not in HOOKS:
            raise LoaderConfigError(f"site {site!r} is not one of {', '.join((HIDDEN, *SITES))}")
        if not 0 <= layer < num_hidden_layers:
            raise LoaderConfigError(f"layer {layer} is not a decoder layer of a {num_hidden_layers}-layer model")
        return f"blocks.{layer}.{HOOKS[site]}"
    if not 0 <= layer <= num_hidden_layers:
        raise LoaderConfigError(f"layer {layer} is not a hidden-state index of a {num_hidden_layers}-layer model")
    if layer == 0:
        return "blocks.0.hook_resid_pre"
    if layer == num_hidden_layers:
        return "ln_final.hook_normalized"
    return f"blocks.{layer - 1}.hook_resid_post"


def data_provider(loader: ActivationLoader) -> Iterator[Any]:
    """The loader as SAELens's `DataProvider`: [batch, d_in] torch tensors, without end."""
    if loader.output != "torch" or len(loader.layers) != 1:
        raise LoaderConfigError("SAELens needs output='torch' and a single layer; build the loader with "
                                "ActivationLoader(..., layers=L, output='torch')")  # fmt: skip
    if loader.epochs is not None:
        raise LoaderConfigError("SAELens draws batches until its token budget is spent; pass epochs=None")
    if loader.return_token_ids or loader.return_positions:
        raise LoaderConfigError("SAELens takes activations only; pass return_token_ids=False, return_positions=False")
    return iter(loader)


def export_cached_activations(
    source: str, directory: str | pathlib.Path, *, layer: int, context_size: int, dtype: str = "float32",
    rows_per_write: int = 256, client: Any = None, site: str = HIDDEN,
) -> dict[str, Any]:  # fmt: skip
    """Write SAELens's cached-activations layout for one hidden state (or one hook site's `layer`); returns a
    summary (hook, rows, tokens)."""
    import datasets
    import numpy as np

    if dtype not in ("float32", "float16"):
        raise LoaderConfigError(f"dtype {dtype!r}: SAELens's Array2D cache holds float32 or float16")
    loader = ActivationLoader(source, layers=layer, site=site, batch_size=context_size, shuffle=False,
                              drop_last=True, return_positions=True, dtype=dtype, client=client)  # fmt: skip
    reference = loader.shards[0].url
    from activations.reader import read_header

    header = read_header(reference, loader._reader)
    metadata = header.metadata
    if "num_hidden_layers" not in metadata:
        raise ActivationsError(f"shard {reference}: metadata has no num_hidden_layers; cannot name the hook")
    hook = hook_name(layer, int(metadata["num_hidden_layers"]), site)
    features = datasets.Features({
        hook: datasets.Array2D(shape=(context_size, loader.hidden_size), dtype=dtype),
        "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size),
        "positions": datasets.Sequence(datasets.Value("int32"), length=context_size),
    })  # fmt: skip

    import tempfile

    from datasets.arrow_writer import ArrowWriter

    # Written row by row through an Arrow file (bounded memory), then saved in the `save_to_disk` layout.
    with tempfile.TemporaryDirectory(prefix="saelens-export-") as scratch:
        arrow = pathlib.Path(scratch) / "rows.arrow"
        with ArrowWriter(features=features, path=str(arrow), writer_batch_size=rows_per_write) as writer:
            for activations, token_ids, positions in loader:
                writer.write({hook: activations, "token_ids": token_ids.astype(np.int32), "positions": positions})
            writer.finalize()
        loader.close()
        dataset = datasets.Dataset.from_file(str(arrow))
        dataset.save_to_disk(str(directory))
    return {"hook": hook, "rows": len(dataset), "tokens": len(dataset) * context_size, "d_in": loader.hidden_size,
            "sampled": header.sampled}  # fmt: skip
