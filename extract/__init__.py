"""Activation extraction: hidden states and hook sites of GPT-2, Pythia (GPT-NeoX), Llama, Mistral, Qwen, Phi-3,
OLMo 2 and Gemma models (`extract.families.FAMILIES`), computed with JAX/Flax NNX and written as safetensors shards."""
