"""A small model exported as a Hugging Face directory (no torch needed): shared by the tests of
Hugging Face directories as files, in process and launched."""
from __future__ import annotations

import numpy as np

from mpipar.checkpoint.huggingface import save_hf
from mpipar.config import ModelConfig
from mpipar.layout import resolve_model
from mpipar.model.params import init_params

MODEL = resolve_model(ModelConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2,
                                  ffn_hidden=64))


def export_small_model(path) -> dict[str, np.ndarray]:
    """Write :data:`MODEL` with its seed-3 float32 parameters as a Hugging Face directory at
    ``path``; return the parameters by mpipar name."""
    params = init_params(MODEL, 3, np.float32)
    save_hf(path, MODEL, params)
    return params
