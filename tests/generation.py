"""What the generation tests share: a random float64 byte-level LlamaForCausalLM written by
transformers' ``save_pretrained``, transformers' greedy ``generate`` of it (the reference), and
mpipar's Generator of a model on a tp x pp layout."""
from __future__ import annotations

import numpy as np
import pytest

from mpipar.config import Config, ParallelConfig, TrainConfig
from mpipar.inference.generator import Generator
from mpipar.rules import validate

V, H, HEADS, KV, LAYERS, FFN = 256, 48, 6, 2, 2, 80   # byte-level: prompts are UTF-8 bytes
PROMPT = "hello"
NEW = 12


@pytest.fixture(scope="module")
def transformers_llama():
    """transformers, with the float64 patches of :mod:`transformers_reference`: its RoPE and
    RMSNorm computed in the model's dtype, so its float64 model is float64 throughout."""
    pytest.importorskip("torch", reason="torch is a test-only dependency (pip install "
                                        "torch==2.13.0)")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    from transformers_reference import rmsnorm_own_dtype, rotary_float64
    patch = pytest.MonkeyPatch()
    patch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_own_dtype)
    patch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary_float64)
    yield transformers
    patch.undo()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, transformers_llama):
    """A random float64 byte-level LlamaForCausalLM written by save_pretrained."""
    import torch
    cfg = transformers_llama.LlamaConfig(
        vocab_size=V, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
        num_hidden_layers=LAYERS, intermediate_size=FFN, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers_llama.LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():  # larger weights than the default init, norms away from 1
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    return path


def transformers_greedy(transformers, path, prompt: list[int], new: int
                        ) -> tuple[list[int], np.ndarray]:
    """(transformers' greedy ``generate`` of ``new`` tokens, the float64 logits of the whole
    generated sequence's forward at the positions that chose them ``[new, V]``)."""
    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                              attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # always `new` tokens, as mpipar without EOS
    model.config._experts_implementation = "eager"   # a mixture of experts' in float64
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        logits = model(out).logits[0, len(prompt) - 1:-1].numpy()
    return out[0, len(prompt):].tolist(), logits


def build_generator(model_cfg, comm, tp: int = 1, pp: int = 1, dtype: str = "float64") -> Generator:
    """A Generator of ``model_cfg`` on ``comm`` under tp x pp (the numpy backend)."""
    train = TrainConfig(seq_len=1, global_batch_size=1, dtype=dtype, backend="numpy")
    return Generator(validate(Config(model_cfg, ParallelConfig(dp=1, tp=tp, pp=pp), train),
                              comm.Get_size()), comm)
