"""The exact float64 reference of the Hugging Face tests: small random Llama, Qwen2, Qwen3 and Mistral
checkpoints written by transformers' ``save_pretrained`` (:data:`MODELS`), transformers with its
float32 casts removed, its training with ``torch.optim.AdamW``, and mpipar engines on the same
checkpoints and samples. Shared by the one-process and multi-rank comparisons and by generation.

transformers is not float64 throughout, even for a float64 model (transformers 5.x source,
``models/{llama,qwen2}/modeling_*.py``, ``modeling_rope_utils.py`` and ``loss/loss_utils.py``):

- the rotary embedding: ``inv_freq`` is built with ``dtype=torch.float`` by the rope_type's
  init function and ``forward`` computes ``position_ids.float() * inv_freq.float()`` and its
  cos/sin in float32;
- ``LlamaRMSNorm.forward`` (and Qwen2's) casts the hidden state ``.to(torch.float32)`` before
  normalising;
- ``ForCausalLMLoss`` computes the loss from ``logits.float()``.

mpipar computes all three in the working dtype (RoPE angles in float64). So the exact reference
(:func:`float64_transformers`) runs transformers' own RoPE init function of the config's
``rope_type`` with ``torch.float`` and the default dtype set to float64, replaces the RMSNorm
forward by the same formula in the tensor's own dtype, and computes
``ForCausalLMLoss``'s cross-entropy in float64; the unpatched model is also compared and must differ at
float32 round-off (1e-9 .. 1e-5 relative), so the gap is explained rather than hidden.
- the ``eager`` attention (Mistral's, which the issue asks to compare against) computes its
  softmax with ``dtype=torch.float32``.

The exact reference also runs that softmax in the scores' own dtype. Llama and Qwen2 run with
``sdpa`` (float64 on CPU); Mistral runs ``eager``, with its sliding-window mask.

Importing this module skips the importing test module where torch or transformers is missing.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is a test-only dependency of the Hugging Face tests "
                    "(pip install torch==2.13.0)")
transformers = pytest.importorskip(
    "transformers", reason="transformers is a test-only dependency of the Hugging Face tests")
from mpi4py import MPI  # noqa: E402
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,  # noqa: E402
                          Qwen3Config)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from mpipar.checkpoint.huggingface import mpipar_name, save_hf  # noqa: E402
from mpipar.data.sources import load_tokens  # noqa: E402
from mpipar.rules import validate  # noqa: E402
from mpipar.training import step as trainer  # noqa: E402
from mpipar.training.rank import Rank, build_rank  # noqa: E402

V, H, HEADS, KV, LAYERS, FFN, THETA, EPS = 97, 48, 6, 2, 2, 80, 10000.0, 1e-6
B, S, STEPS = 2, 12, 3
OPT = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=0.5)
TOL = 1e-10
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8, "rope_theta": THETA}
"""Llama 3.1's rule with a pretraining context of 8 < S: of the 4 frequencies of head_dim 8
(wavelengths 6.3, 63, 628, 6283) one is interpolated and three are divided by the factor."""
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
        "rope_theta": THETA}
"""YaRN over a pretraining context of 4096: of the 6 frequencies of head_dim 12 the correction
range [1, 5] keeps two, blends three and divides the last by the factor; the tables carry the
attention factor 0.1 ln 4 + 1."""

MODELS = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3-tied": (LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=LLAMA3,
                                      max_position_embeddings=64)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False)),
    # Per-head q/k RMSNorms, and a head dim of 12, not hidden / heads = 8.
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=False, head_dim=12)),
    "qwen3-yarn": (Qwen3Config, dict(tie_word_embeddings=False, head_dim=12, rope_parameters=YARN,
                                     max_position_embeddings=4 * 4096)),
    # A sliding window of 5 < S = 12: every query past the fifth loses keys to the window.
    "mistral": (MistralConfig, dict(tie_word_embeddings=False, sliding_window=5)),
    "linear": (LlamaConfig, dict(rope_parameters={"rope_type": "linear", "factor": 3.0,
                                                  "rope_theta": THETA})),
    "dynamic": (LlamaConfig, dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                   "rope_theta": THETA},
                                  max_position_embeddings=8)),  # < S: the NTK theta grows
}
"""Test checkpoints by name: the transformers config class and its settings beyond the sizes."""
def adamw_on_rows(model, trainable: list, rows: Path, steps: int, batch: int, seq: int,
                  vocab: int) -> tuple[list, list]:
    """``steps`` steps of ``torch.optim.AdamW`` (:data:`OPT`, decay on every tensor of
    ``trainable``) on the next-token loss of ``batch`` rows at a time of the token rows saved
    at ``rows``, in order, the gradients clipped by their norm: (losses, gradient norms)."""
    opt = torch.optim.AdamW([{"params": trainable, "weight_decay": OPT["weight_decay"]}],
                            lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])
    ids_all = torch.from_numpy(np.load(rows))
    losses, norms = [], []
    for k in range(steps):
        ids = ids_all[k * batch:(k + 1) * batch]
        opt.zero_grad()
        logits = model(input_ids=ids[:, :seq]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, OPT["clip_grad"]).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms


def rel(a, b) -> float:
    """max |a - b| / max |b| (the relative difference used throughout)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def make_checkpoint(kind: str, root: Path) -> Path:
    """A random float64 model of :data:`MODELS` written by transformers' save_pretrained."""
    config_class, extra = MODELS[kind]
    cfg = config_class(vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                       num_key_value_heads=KV, num_hidden_layers=LAYERS, intermediate_size=FFN,
                       rope_theta=THETA, rms_norm_eps=EPS, **extra)
    return save_random(cfg, root / kind)


def save_random(cfg, path: Path) -> Path:
    """A float64 model of transformers config ``cfg`` with random weights (seed 0) written by
    save_pretrained to ``path``: larger weights than the default init, norms away from 1,
    biases."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1 if name.endswith("norm.weight") else 0
            p.copy_(scale + (0.1 if p.ndim == 1 else 0.15) * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_checkpoint(kind, root) for kind in MODELS}


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    """Token rows ``[STEPS * B, S + 1]``; mpipar's step k trains rows k*B .. (k+1)*B - 1."""
    path = tmp_path_factory.mktemp("data") / "samples.npy"
    np.save(path, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return path


def hf_model(path):
    """The checkpoint at ``path`` in float64: Mistral with transformers' ``eager`` attention
    (its own masking of the window), the others with ``sdpa``."""
    mistral = json.loads((Path(path) / "config.json").read_text())["model_type"] == "mistral"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                attn_implementation="eager" if mistral else "sdpa")


def rmsnorm_own_dtype(self, x):
    """LlamaRMSNorm.forward (and Qwen2's) without the float32 cast: the formula in x's dtype."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@contextlib.contextmanager
def torch_float_is_float64():
    """``torch.float``, ``torch.float32`` and the default dtype are float64: transformers' RoPE
    code, which asks for ``torch.float`` (yarn's ramp for ``torch.float32``) and promotes Python
    scalars to the default dtype, computes in float64."""
    old_float, old_default = torch.float, torch.get_default_dtype()
    torch.float = torch.float32 = torch.float64
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.float = torch.float32 = old_float
        torch.set_default_dtype(old_default)


def rotary_float64(self, x, position_ids):
    """The rotary embedding's forward with transformers' own init function of the config's
    rope_type run in float64, and float64 angles. ``seq_len`` is the sequence's length, as the
    dynamic update takes it (``max(position_ids) + 1``; for the other types it is unused)."""
    init = (self.compute_default_rope_parameters if self.rope_type == "default"
            else ROPE_INIT_FUNCTIONS[self.rope_type])
    with torch.no_grad(), torch_float_is_float64():
        inv_freq, scaling = init(self.config, device=x.device,
                                 seq_len=int(position_ids.max()) + 1)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def router_float64(self, hidden_states):
    """A transformers top-K router's forward (Mixtral's, Qwen2-MoE's) with its softmax in
    float64 (not ``.float()``): the weights renormalised over the K, as Mixtral's always is and
    Qwen2-MoE's with ``norm_topk_prob`` true; with false the K probabilities as they are."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits.to(torch.float64), dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


_EAGER = modeling_mistral.eager_attention_forward


def eager_softmax_own_dtype(module, query, *args, **kwargs):
    """Mistral's ``eager_attention_forward`` with its softmax in the scores' dtype: it asks
    ``nn.functional.softmax`` for ``dtype=torch.float32``, which is dropped for this call."""
    softmax = torch.nn.functional.softmax

    def own_dtype(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim)

    torch.nn.functional.softmax = own_dtype
    try:
        return _EAGER(module, query, *args, **kwargs)
    finally:
        torch.nn.functional.softmax = softmax


_MODULES = ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2"), (modeling_mistral, "Mistral"),
            (modeling_qwen3, "Qwen3"))
PATCHES = [(module.__dict__[f"{name}RMSNorm"], "forward", rmsnorm_own_dtype)
           for module, name in _MODULES] + \
          [(module.__dict__[f"{name}RotaryEmbedding"], "forward", rotary_float64)
           for module, name in _MODULES] + \
          [(modeling_mistral, "eager_attention_forward", eager_softmax_own_dtype)]
"""(class or module, attribute, replacement) of every float32 cast the exact reference removes."""


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers' models with RMSNorm, RoPE and the eager softmax computed in the model dtype
    (see the module docstring)."""
    for owner, attr, replacement in PATCHES:
        monkeypatch.setattr(owner, attr, replacement)


def hf_loss(logits, rows):
    """ForCausalLMLoss's mean cross-entropy of the logits of ``rows[:, :-1]`` ``[B, S, V]``
    against the next tokens ``rows[:, 1:]`` (its label shift), in the logits' dtype (without its
    ``logits.float()`` for float64 logits). The model sees the S inputs alone, as mpipar does:
    dynamic RoPE depends on the sequence's length."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             rows[:, 1:].reshape(-1))


def mpipar_rank(model_cfg: ModelConfig, params, samples, comm=MPI.COMM_SELF,
                  train_fields=(), **parallel) -> Rank:
    """A Rank on ``comm`` with ``params`` loaded, training the samples' rows in order;
    ``train_fields``: more fields of the train section beyond :data:`OPT` (a mapping or
    (field, value) pairs)."""
    train = TrainConfig(steps=STEPS, seq_len=S, global_batch_size=B,
                        micro_batch_size=1 if parallel else 0, lr_schedule="constant",
                        warmup_steps=0, min_lr=0.0, dtype="float64", backend="numpy",
                        shuffle=False, seed=0, **OPT, **dict(train_fields or ()))
    cfg = validate(Config(model_cfg, ParallelConfig(**parallel), train), comm.Get_size())
    rank = build_rank(cfg, comm, source=load_tokens(str(samples), V, S))
    trainer.load_params(rank, params)
    return rank


def mpipar_logits(rank: Rank, tokens: np.ndarray) -> np.ndarray:
    """Logits ``[B, S, V]`` of ``tokens [B, S]`` (the forward's LM head output)."""
    _, cache = rank.model.chunks[0].forward(rank.params, tokens, rank.model.positions,
                                            np.zeros_like(tokens))
    return cache.head.logits.reshape(tokens.shape + (-1,))


def transformers_logits(path, tokens: np.ndarray, architecture: str | None = None) -> np.ndarray:
    """transformers' float64 logits of ``tokens`` from the checkpoint at ``path`` (experts
    ``eager``: its grouped GEMM takes no float64); ``architecture``: the class it must load as."""
    model = hf_model(path)
    assert architecture is None or type(model).__name__ == architecture, type(model).__name__
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens)).logits.numpy()


def assert_export_gives_mpipar_logits(cfg: ModelConfig, params, rows, out,
                                      architecture: str) -> dict:
    """``params`` of model ``cfg`` exported to ``out`` (--export-hf's writer): written as
    ``architecture``, transformers loads them as it and computes mpipar's logits of the first
    B rows of ``rows`` to TOL. Returns the written config.json."""
    save_hf(out, cfg, params)
    raw = json.loads((Path(out) / "config.json").read_text())
    assert raw["architectures"] == [architecture], raw["architectures"]
    tokens = np.load(rows)[:B, :S]
    rank = mpipar_rank(cfg, params, rows)
    want = mpipar_logits(rank, tokens)
    trainer.close(rank)
    assert rel(want, transformers_logits(out, tokens, architecture)) <= TOL
    return raw


def torch_adamw(model) -> "torch.optim.AdamW":
    """torch.optim.AdamW with :data:`OPT`, weight decay on the matrices only (mpipar's rule)."""
    params = dict(model.named_parameters()).values()  # a tied head is the embedding: once
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                               "weight_decay": OPT["weight_decay"]},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])


@functools.lru_cache(maxsize=None)
def torch_training(path: Path, samples: Path, optimizer=torch_adamw
                   ) -> tuple[list, list, dict[str, np.ndarray]]:
    """transformers + ``optimizer(model)`` (default torch.optim.AdamW, decay on matrices only;
    clipping) for STEPS steps on the samples' rows in order, with the float32 casts removed:
    (losses, gradient norms, trained parameters by mpipar name). Call it with the float64
    patches applied."""
    model = hf_model(path)
    model.train()
    named = dict(model.named_parameters())  # a tied head is the embedding: listed once
    opt = optimizer(model)
    rows = torch.from_numpy(np.load(samples))
    losses, norms = [], []
    for k in range(STEPS):
        ids = rows[k * B:(k + 1) * B]
        opt.zero_grad()
        loss = hf_loss(model(input_ids=ids[:, :S]).logits, ids)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"]).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, {mpipar_name(n): p.detach().numpy().copy() for n, p in named.items()}


def training_differences(results, trained: dict, want) -> tuple[list[float], float]:
    """(relative loss differences per step, max relative parameter difference) of an mpipar
    run against :func:`torch_training`'s; raises AssertionError on a norm or name mismatch."""
    losses, norms, params = want
    assert sorted(trained) == sorted(params)
    for r, norm in zip(results, norms):
        assert abs(r.grad_norm - norm) <= TOL * norm, (r.grad_norm, norm)
    return ([abs(r.loss - loss) / loss for r, loss in zip(results, losses)],
            max(rel(v, params[n]) for n, v in trained.items()))
