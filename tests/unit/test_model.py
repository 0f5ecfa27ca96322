"""The Llama stage on one process: forward against a naive reference, backward against float64
finite differences for every parameter, and backends against each other."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpipar.config import ModelConfig
from mpipar.kernels import get_backend
from mpipar.kernels.rope_frequencies import rope_inv_freq
from mpipar.model.attention import LocalAttention
from mpipar.model.llama import LlamaStage
from mpipar.model.params import init_params, param_specs
from mpipar.parallel.placement import TP_ROLES, PlacementTable
from mpipar.parallel.tensor.ops import TensorParallel
from mpipar.layout import resolve_model

CFG = resolve_model(ModelConfig(vocab_size=11, hidden=16, layers=2, heads=4, kv_heads=2, ffn_hidden=24,
                  rope_theta=500.0, init_std=0.3))
# One parameter for embedding and LM head, q/k/v biases, llama3 RoPE (pretraining context 4 < 7).
TIED = dataclasses.replace(CFG, tie_embeddings=True, attention_bias=True, rope_type="llama3",
                           rope_factor=4.0, rope_original_max_positions=4)


def make_stage(backend: str = "numpy", cfg: ModelConfig = CFG, **options) -> LlamaStage:
    """The whole model as one stage on one process (``options``: recompute, store)."""
    k = get_backend(backend)
    return LlamaStage(cfg=cfg, kernels=k, layers=range(cfg.layers), first=True, last=True,
                      tp=TensorParallel(kernels=k, table=PlacementTable(model=cfg)),
                      attention=LocalAttention(k), **options)


def random_biases(params: dict, seed: int) -> dict:
    """``params`` with random (not the initial zero) biases, so that they matter."""
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.3, v.shape) if n.endswith(".bias") else v for n, v in params.items()}


def batch(seed: int = 0, B: int = 2, S: int = 7):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CFG.vocab_size, (B, S)), rng.integers(0, CFG.vocab_size, (B, S))


def naive_loss(p: dict, tokens: np.ndarray, targets: np.ndarray, c: ModelConfig = CFG) -> float:
    """The Llama forward written out directly (no kernels but the RoPE frequency rule, tested in
    test_kernels.py), float64; biases and a tied head when ``p`` has them."""
    B, S = tokens.shape
    D, hq, hkv = c.head_dim, c.heads, c.kv_heads
    zero = np.zeros(1)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * w

    def rope(x):  # [B, S, h, D], rotate-half
        inv = rope_inv_freq(D, c.rope_theta, c.rope_type, c.rope_factor, c.rope_low_freq_factor,
                            c.rope_high_freq_factor, c.rope_original_max_positions, S)
        ang = np.arange(S)[:, None] * inv[None, :]
        cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None, :]
        rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + rot * sin

    x = p["embed_tokens.weight"][tokens]
    for i in range(c.layers):
        n = f"layers.{i}."
        h = rms(x, p[n + "input_layernorm.weight"])
        q, k, v = (h @ p[n + f"self_attn.{x}_proj.weight"].T + p.get(n + f"self_attn.{x}_proj.bias",
                                                                    zero) for x in "qkv")
        q, k = rope(q.reshape(B, S, hq, D)), rope(k.reshape(B, S, hkv, D))
        v = v.reshape(B, S, hkv, D)
        k, v = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, S, hq * D)
        x = x + o @ p[n + "self_attn.o_proj.weight"].T
        h = rms(x, p[n + "post_attention_layernorm.weight"])
        g, u = h @ p[n + "mlp.gate_proj.weight"].T, h @ p[n + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ p[n + "mlp.down_proj.weight"].T
    logits = rms(x, p["norm.weight"]) @ p.get("lm_head.weight", p["embed_tokens.weight"]).T
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return float((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean())


def loss_and_grads(stage, params, tokens, targets):
    loss, cache = stage.forward(params, tokens, np.arange(tokens.shape[1]), targets)
    grads = {n: np.zeros_like(v) for n, v in params.items()}
    stage.backward(params, grads, np.full(tokens.shape, 1.0 / tokens.size), cache)
    return float(loss.mean()), grads


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["llama", "tied-bias-llama3"])
def test_forward_matches_naive_reference(cfg):
    stage = make_stage(cfg=cfg)
    params = random_biases(init_params(cfg, 7, np.float64), 1)
    tokens, targets = batch()
    loss, _ = loss_and_grads(stage, params, tokens, targets)
    ref = naive_loss(params, tokens, targets, cfg)
    assert abs(loss - ref) <= 1e-12 * abs(ref)


class _RefusingStore:
    """An offload store that fails the test if anything is put into it."""

    def put(self, tree):
        raise AssertionError("forward_only kept an activation record")

    def take(self, handle):
        raise AssertionError("forward_only read an activation record")


def test_forward_only_keeps_nothing_and_equals_the_training_forward():
    stage = make_stage(recompute="offload", store=_RefusingStore())
    params = init_params(CFG, 7, np.float64)
    tokens, targets = batch()
    positions = np.arange(tokens.shape[1])
    loss = stage.forward_only(params, tokens, positions, targets)
    want = make_stage().forward(params, tokens, positions, targets)[0]
    np.testing.assert_array_equal(loss, want)
    assert abs(loss.mean() - naive_loss(params, tokens, targets)) <= 1e-12 * loss.mean()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_kv_cache_decoding_equals_the_whole_sequence_forward(backend):
    """A prompt of 4 tokens, then one token at a time through the KV cache: each step's logits
    equal those of the whole sequence's forward at that position (float64)."""
    from mpipar.model.llama import KVCache
    stage = make_stage(backend)
    params = init_params(CFG, 5, np.float64)
    tokens = batch(2, B=2, S=9)[0]
    whole = stage.forward_only(params, tokens, np.arange(9)).reshape(2, 9, -1)
    kv = KVCache.empty(np, stage.layers, 2, 9, CFG.kv_heads, CFG.head_dim, np.float64)
    steps = [(0, 4)] + [(s, s + 1) for s in range(4, 9)]
    for start, stop in steps:
        got = stage.forward_only(params, tokens[:, start:stop], np.arange(start, stop), kv=kv)
        kv.length = stop
        want = whole[:, start:stop]
        err = np.abs(got.reshape(want.shape) - want).max() / np.abs(want).max()
        assert err <= 1e-13, (start, err)
    with pytest.raises(ValueError, match="position 9 is beyond its capacity of 9"):
        stage.forward_only(params, tokens[:, :1], np.arange(9, 10), kv=kv)


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["llama", "tied-bias-llama3"])
def test_every_parameter_gradient_matches_finite_differences(cfg):
    stage = make_stage(cfg=cfg)
    params = random_biases(init_params(cfg, 3, np.float64), 2)
    tokens, targets = batch(1)
    _, grads = loss_and_grads(stage, params, tokens, targets)
    assert set(grads) == {s.name for s in param_specs(cfg)}
    assert ("lm_head.weight" in grads) != cfg.tie_embeddings
    rng = np.random.default_rng(0)
    h = 1e-5
    for name, value in params.items():
        flat = value.reshape(-1)
        # Embedding rows of tokens that appear, plus random entries everywhere else.
        picks = rng.choice(flat.size, size=min(flat.size, 6), replace=False)
        if name == "embed_tokens.weight":
            picks = np.concatenate([picks, tokens[0, 0] * cfg.hidden + np.arange(3)])
        for j in picks:
            old = flat[j]
            flat[j] = old + h
            up = loss_and_grads(stage, params, tokens, targets)[0]
            flat[j] = old - h
            down = loss_and_grads(stage, params, tokens, targets)[0]
            flat[j] = old
            fd = (up - down) / (2 * h)
            got = grads[name].reshape(-1)[j]
            assert abs(got - fd) <= 1e-6 * max(1e-3, abs(fd)), (name, j, got, fd)


def test_loss_at_init_is_near_uniform():
    """With a small init the model predicts nearly uniformly: loss ~= log(vocab)."""
    cfg = resolve_model(ModelConfig(vocab_size=11, hidden=16, layers=2, heads=4, kv_heads=2,
                                    ffn_hidden=24, init_std=1e-4))
    stage = make_stage(cfg=cfg)
    tokens, targets = batch()
    loss, _ = loss_and_grads(stage, init_params(cfg, 0, np.float64), tokens, targets)
    assert abs(loss - np.log(11)) < 1e-3


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["llama", "tied-bias-llama3"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-11), (np.float32, 2e-4)])
def test_numba_backend_equals_numpy_on_the_model(dtype, tol, cfg):
    tokens, targets = batch(2)
    params = {n: v.astype(dtype) for n, v in random_biases(init_params(cfg, 5, dtype), 3).items()}
    l_np, g_np = loss_and_grads(make_stage("numpy", cfg), params, tokens, targets)
    l_nb, g_nb = loss_and_grads(make_stage("numba", cfg), params, tokens, targets)
    assert abs(l_np - l_nb) <= tol * abs(l_np)
    for name in g_np:
        scale = np.abs(g_np[name]).max()
        assert np.abs(g_np[name] - g_nb[name]).max() <= tol * max(scale, 1e-30), name


class _LinearsSeen:
    """The numpy kernels, recording the weight of every linear they run (forward and
    backward), and those run outside the tensor-parallel seam. A weight stacked with others
    for one GEMM (q/k/v, gate/up) counts as each of its parts: ``xp.concatenate`` records
    what it stacked."""

    def __init__(self, kernels) -> None:
        self.kernels, self.weights, self.outside, self.in_seam = kernels, set(), set(), 0
        self.stacked: dict[int, tuple] = {}     # id -> (the stacked array, its parts' ids)
        self.xp = _Stacking(self)

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def _saw(self, w) -> None:
        if w is None:          # a weight-gradient-only call: its weight is counted elsewhere
            return
        base = w if w.base is None else w.base       # w.T of a stacked weight
        parts = self.stacked[id(base)][1] if id(base) in self.stacked else [id(w)]
        self.weights.update(parts)
        if not self.in_seam:
            self.outside.update(parts)

    def linear_fwd(self, x, w, b=None):
        self._saw(w)
        return self.kernels.linear_fwd(x, w, b)

    def linear_bwd(self, dy, x, w, dw=None):
        self._saw(w)
        return self.kernels.linear_bwd(dy, x, w, dw=dw)

    def concat(self, arrays, axis=-1):
        """The kernels' join (stacked weights, axis 0), telling which arrays it stacked."""
        arrays = list(arrays)
        out = self.kernels.concat(arrays, axis=axis)
        self.stacked[id(out)] = (out, [id(a) for a in arrays])   # out kept: ids stay unique
        return out


class _Stacking:
    """NumPy, with ``concatenate`` telling :class:`_LinearsSeen` which arrays it stacked."""

    def __init__(self, seen: _LinearsSeen) -> None:
        self.seen = seen

    def __getattr__(self, name: str):
        return getattr(np, name)

    def concatenate(self, arrays, axis=0):
        arrays = list(arrays)
        out = np.concatenate(arrays, axis=axis)
        self.seen.stacked[id(out)] = (out, [id(a) for a in arrays])   # out kept: ids stay unique
        return out


class _RolesAsked(TensorParallel):
    """TensorParallel recording the parameters whose role it read in the placement table, and
    telling its kernels while one of its linears runs."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.asked: set[str] = set()

    def role(self, names):
        self.asked.update(names)
        return super().role(names)

    def linear(self, *args):
        self.kernels.in_seam += 1
        out = super().linear(*args)
        self.kernels.in_seam -= 1
        return out

    def linear_backward(self, *args):
        self.kernels.in_seam += 1
        out = super().linear_backward(*args)
        self.kernels.in_seam -= 1
        return out


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["llama", "tied-bias-llama3"])
def test_every_linear_the_model_runs_takes_its_role_from_the_placement_table(cfg):
    """The placement table is the one statement of each linear's tensor-parallel role: every
    linear a kernel runs in forward and backward runs inside the tensor-parallel seam, on a
    weight whose role the seam read in the table (a linear the block ran past the seam would
    show here), and they are all of the model's weight matrices but an untied embedding (a
    lookup)."""
    k = _LinearsSeen(get_backend("numpy"))
    table = PlacementTable(model=cfg)
    tp = _RolesAsked(kernels=k, table=table)
    stage = LlamaStage(cfg=cfg, kernels=k, layers=range(cfg.layers), first=True, last=True,
                       tp=tp, attention=LocalAttention(k))
    params = init_params(cfg, 7, np.float64)
    loss_and_grads(stage, params, *batch())
    multiplied = {n for n, v in params.items() if id(v) in k.weights}
    matrices = {s.name for s in param_specs(cfg) if len(s.shape) == 2}
    assert multiplied == matrices - ({"embed_tokens.weight"} - {stage.head.weight})
    assert not {n for n, v in params.items() if id(v) in k.outside}
    assert multiplied <= tp.asked
    assert {table[n].tp for n in tp.asked} <= set(TP_ROLES)


def test_the_tensor_parallel_seam_refuses_what_the_table_does_not_say():
    """A linear with no row in the placement table, linears sharing an input with different
    roles, and an embedding not vocabulary-parallel are errors, not a guess."""
    tp = TensorParallel(kernels=get_backend("numpy"), table=PlacementTable(model=CFG))
    with pytest.raises(KeyError, match="no row for it"):
        tp.role(["layers.0.mlp.gate_proj.weight", "layers.0.mlp.shortcut.weight"])
    with pytest.raises(ValueError, match=r"roles \['column', 'row'\]"):
        tp.role(["layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="must be vocabulary-parallel"):
        tp.embed({"norm.weight": np.ones(16)}, "norm.weight", np.zeros((1, 2), int))
