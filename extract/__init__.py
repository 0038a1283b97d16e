"""Activation extraction: Qwen hidden states computed with JAX/Flax NNX and written as safetensors shards."""
