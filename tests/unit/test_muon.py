"""Muon (``--optimizer muon``) in one process, against ``torch.optim.Muon`` in float64.

torch runs Newton-Schulz in bf16 (``_zeropower_via_newtonschulz`` casts to ``bfloat16``); the
reference replaces that function by the same iteration in the tensor's own dtype (float64), so
mpipar's float64 Newton-Schulz must equal it to round-off. The training comparison is a small
random Llama of :mod:`transformers_reference` (its float32 casts removed): torch.optim.Muon on
every 2-D weight of the decoder blocks, torch.optim.AdamW (decay on matrices) on the rest,
clipping by the global norm first; losses, gradient norms and trained weights agree to 1e-10.
Layouts: mpi/test_muon.py."""
from __future__ import annotations

import numpy as np
import pytest

from transformers_reference import (OPT, STEPS, TOL, float64_transformers, hf_dirs,  # noqa: F401
                                    mpipar_rank, rel, samples, torch, torch_training,
                                    training_differences)
from torch.optim import _muon as torch_muon

from mpipar.checkpoint.huggingface import load_hf
from mpipar.config import Config, ConfigError, TrainConfig
from mpipar.rules import validate
from mpipar.training import muon
from mpipar.training import step as trainer


def ns_own_dtype(grad, ns_coefficients, ns_steps, eps):
    """torch's ``_zeropower_via_newtonschulz`` in the gradient's own dtype (no bf16 cast)."""
    a, b, c = ns_coefficients
    x = grad.clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@pytest.fixture
def float64_muon(monkeypatch):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", ns_own_dtype)


@pytest.mark.parametrize("shape", [(6, 6), (5, 9), (9, 5), (1, 7)])
def test_newton_schulz_equals_torch(shape, float64_muon):
    g = np.random.default_rng(1).standard_normal(shape)
    want = torch_muon._zeropower_via_newtonschulz(torch.from_numpy(g), muon.NS_COEFFICIENTS,
                                                  5, muon.NS_EPS).numpy()
    assert rel(muon.newton_schulz(g, 5), want) <= 1e-13
    if min(shape) == 1:
        return
    # It orthogonalises: the singular values move from a spread towards 1.
    s0 = np.linalg.svd(g / np.linalg.norm(g), compute_uv=False)
    s = np.linalg.svd(muon.newton_schulz(g, 5), compute_uv=False)
    assert np.abs(s - 1).max() < 0.35 < np.abs(s0 - 1).max()


def test_zero_update_stays_zero():
    assert not muon.newton_schulz(np.zeros((3, 4)), 5).any()


@pytest.mark.parametrize("nesterov", [True, False])
def test_step_equals_torch_muon(nesterov, float64_muon):
    """Three steps on one tall matrix: momentum lerp, Nesterov or not, decay, adjusted lr."""
    rng = np.random.default_rng(2)
    w0, grads = rng.standard_normal((8, 3)), rng.standard_normal((3, 8, 3))
    for adjust in muon.ADJUST_LR.values():
        p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
        opt = torch.optim.Muon([p], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                               adjust_lr_fn=adjust.name)
        w, buf = w0.copy(), np.zeros_like(w0)
        for g in grads:
            p.grad = torch.from_numpy(g.copy())
            opt.step()
            u = muon.momentum_update(buf, g, 0.9, nesterov)
            muon.apply_update(w, muon.newton_schulz(u, 5), 0.02, 0.1, adjust.ratio(8, 3))
        assert rel(w, p.detach().numpy()) <= 1e-14
        assert rel(buf, opt.state[p]["momentum_buffer"].numpy()) <= 1e-15


def test_which_matrices():
    assert muon.is_muon_matrix("layers.0.self_attn.q_proj.weight", (8, 4))
    assert muon.is_muon_matrix("layers.1.block_sparse_moe.experts.3.w2.weight", (4, 8))
    for name, shape in (("embed_tokens.weight", (9, 4)), ("lm_head.weight", (9, 4)),
                        ("layers.0.input_layernorm.weight", (4,)),
                        ("layers.0.self_attn.q_proj.bias", (8,)),
                        ("layers.1.block_sparse_moe.gate.weight", (4, 4)),
                        ("layers.1.mlp.shared_expert_gate.weight", (1, 4))):
        assert not muon.is_muon_matrix(name, shape)


class TorchMuonAdamW:
    """torch.optim.Muon on the decoder blocks' 2-D weights, torch.optim.AdamW on the rest (decay
    on matrices only), stepped together."""

    def __init__(self, model, momentum: float, nesterov: bool, adjust: str) -> None:
        named = dict(model.named_parameters())
        blocks = [p for n, p in named.items() if ".layers." in n and p.ndim == 2]
        rest = [p for n, p in named.items() if not (".layers." in n and p.ndim == 2)]
        self.opts = [
            torch.optim.Muon(blocks, lr=OPT["lr"], weight_decay=OPT["weight_decay"],
                             momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust),
            torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2],
                                "weight_decay": OPT["weight_decay"]},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])]

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self):
        for o in self.opts:
            o.step()


SETTINGS = {"default": (0.95, True, "original"),
            "plain-rms": (0.9, False, "match_rms_adamw")}


def torch_muon_training(path, samples, setting):
    momentum, nesterov, adjust = SETTINGS[setting]
    return torch_training(path, samples,
                          lambda model: TorchMuonAdamW(model, momentum, nesterov, adjust))


def muon_fields(setting: str) -> tuple:
    momentum, nesterov, adjust = SETTINGS[setting]
    return (("optimizer", "muon"), ("muon_momentum", momentum), ("muon_nesterov", nesterov),
            ("muon_adjust_lr", adjust))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_training_equals_torch_muon_and_adamw(hf_dirs, samples, setting, float64_transformers,
                                              float64_muon):
    cfg, params = load_hf(hf_dirs["llama"])
    rank = mpipar_rank(cfg, params, samples, train_fields=muon_fields(setting))
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    want = torch_muon_training(hf_dirs["llama"], samples, setting)
    assert want[1][0] > OPT["clip_grad"]  # clipping is exercised
    loss_diffs, param_diff = training_differences(results, trained, want)
    print(f"\nmuon {setting}: param rel diff {param_diff:.2e}, loss diffs {loss_diffs}")
    assert max(loss_diffs) <= TOL and param_diff <= TOL
    # Muon moved the matrices differently from AdamW: the comparison is not AdamW's.
    adamw = torch_training(hf_dirs["llama"], samples)[2]
    q = "layers.0.self_attn.q_proj.weight"
    assert rel(trained[q], adamw[q]) > 1e-3


@pytest.mark.parametrize("field, value, rule", [
    ("muon_ns_steps", 0, "muon_ns_steps=0: must be >= 1"),
    ("muon_momentum", 1.0, r"muon_momentum=1.0: must be in \[0, 1\)"),
    ("muon_momentum", -0.1, r"muon_momentum=-0.1: must be in \[0, 1\)"),
    ("muon_adjust_lr", "spectral", "muon_adjust_lr='spectral'"),
    ("optimizer", "sgd", "optimizer='sgd'"),
])
def test_bad_settings_are_refused(field, value, rule):
    cfg = Config(train=TrainConfig(**{"optimizer": "muon", field: value}))
    with pytest.raises(ConfigError, match=rule):
        validate(cfg, 1)


def test_config_choices_are_the_registries():
    """config sits below training and cannot read the registries: the choices it lists are
    theirs, in their order."""
    from dataclasses import fields
    from mpipar.training.optimizers import OPTIMIZERS
    choices = {f.name: f.metadata["choices"] for f in fields(TrainConfig)}
    assert choices["optimizer"] == tuple(OPTIMIZERS)
    assert choices["muon_adjust_lr"] == tuple(muon.ADJUST_LR)


@pytest.mark.parametrize("flags, message", [
    (["--muon-ns-steps", "0"], "train.muon_ns_steps=0: must be >= 1"),
    (["--muon-momentum", "1"], "train.muon_momentum=1.0: must be in [0, 1)"),
    (["--muon-adjust-lr", "spectral"], "invalid choice: 'spectral'"),
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
    (["--reset-optimizer"], "train.reset_optimizer=True: needs --resume"),
])
def test_bad_flags_exit_2_naming_value_and_rule(flags, message, capsys):
    from mpipar.train import resolve_config
    with pytest.raises(SystemExit) as exc:
        resolve_config(["--optimizer", "muon", *flags], 1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_owners_balance_newton_schulz_flops():
    """Largest first onto the least loaded owner: no owner carries more than the lightest plus
    the largest matrix; a matrix every tp rank holds whole loads every tp rank of its slot."""
    from mpipar.training.optimizers import assign_owners
    shapes = {f"layers.{i}.m{j}": (8 * (j + 1), 16) for i in range(4) for j in range(5)}
    split = {n for n in shapes if n.endswith(("m0", "m2", "m4"))}
    owners = assign_owners(shapes, split, slots=3, tp=2, steps=5)
    load = np.zeros((3, 2))
    for n, (a, b) in owners.items():
        f = muon.ns_flops(*shapes[n], 5)
        if n in split:
            load[a, b] += f
        else:
            load[a, :] += f
    biggest = max(muon.ns_flops(*s, 5) for s in shapes.values())
    assert load.max() - load.min() <= biggest
    assert load.sum() == sum(muon.ns_flops(*shapes[n], 5) * (1 if n in split else 2)
                             for n in shapes)
