"""The Hugging Face model families mpipar reads and writes: each ``model_type`` with its
transformers architecture and its config defaults. Which family a model is written as:
:func:`mpipar.checkpoint.huggingface.model_type`; each family's own fields: ``hf_*.py``."""
from __future__ import annotations

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
"""The ``model_type`` values mpipar reads and writes, and their architecture."""

MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 131072, "mixtral": 131072,
                 "qwen2_moe": 32768, "qwen3": 32768, "qwen3_moe": 32768,
                 "deepseek_v3": 4096, "gemma3_text": 131072}
"""transformers' ``max_position_embeddings`` default of each ``model_type``."""
