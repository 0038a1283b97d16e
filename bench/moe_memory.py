"""What fits where for the mixtures of experts at their released sizes: parameters (every expert), the MLP weights a
token multiplies with (router and chosen experts), bfloat16 weights, and the (data, model) layout the automatic mesh
picks on a v4-8, a v5litepod-8, a v6e-8 and 8 H100s for a job of batch 8 at 1,024 tokens, with what one chip then
holds (extract.memory). Shapes only: nothing is downloaded or allocated.

    PYTHONPATH=. python bench/moe_memory.py
"""

from __future__ import annotations

from extract import memory
from extract.config import ModelConfig

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1e6,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False}  # fmt: skip
MIXTRAL_8X7B = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "rope_theta": 1e6, "max_position_embeddings": 32768}  # fmt: skip
OLMOE_1B_7B = {"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
               "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
               "num_experts_per_tok": 8, "max_position_embeddings": 4096}  # fmt: skip
ACCELERATORS = (("v4", 4, "tpu"), ("v5e", 8, "tpu"), ("v6e", 8, "tpu"), ("H100", 8, "gpu"))


def main() -> None:
    print("| model | parameters (no LM head) | active a token | bf16 weights | v4-8 (4 x 32 GiB) | v5litepod-8 (8 x 16 GiB) "
          "| v6e-8 (8 x 32 GiB) | 8 x H100 80GB |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name, raw in (("Mixtral-8x7B", MIXTRAL_8X7B), ("Qwen3-30B-A3B", QWEN3_30B_A3B), ("OLMoE-1B-7B", OLMOE_1B_7B)):
        config = ModelConfig.from_dict(raw)
        layers = config.num_hidden_layers
        total = memory.weight_bytes(config, layers, 1)
        active = sum(config.family.mlp_weights(config, layer) for layer in range(layers))
        cells = []
        for accelerator, chips, platform in ACCELERATORS:
            usable = memory.usable_bytes(accelerator, platform)
            data, model = memory.choose_mesh_shape(config, chips, usable, num_layers=layers, batch_size=8,
                                                   seq_len=1024, compute_bytes=2, out_bytes=2, num_outputs=1)  # fmt: skip
            need = memory.replica_bytes(config, layers, max(1, 8 // data), 1024, 2, 2, 1, model)
            fits = need <= memory.HEADROOM * usable
            cells.append(f"data={data},model={model}: {need / 2**30:.1f} GiB a chip" + ("" if fits else " (too big)"))
        print(f"| {name} | {total / 1e9:.2f} B | router + experts {active / 1e9:.2f} B of MLP | "
              f"{2 * total / 2**30:.1f} GiB | " + " | ".join(cells) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
