"""LoRA against PyTorch + PEFT in float64 on one process (each --recompute mode): a tiny random
Llama with a PEFT adapter of nonzero A and B on all seven targets; losses, gradient norms and the
trained adapter over two AdamW steps; the frozen base (no gradient, no optimizer state,
unchanged); the PEFT files in and out; the merged model against ``merge_and_unload()``; the
rules."""
from __future__ import annotations

import json

import numpy as np
import pytest

from transformers_reference import (OPT, S, TOL, float64_transformers, hf_model,  # noqa: F401
                                    mpipar_rank, rel, samples, torch)
from lora_reference import (ALPHA, LORA_FIELDS, LORA_STEPS, RANK, adapter_tensors,  # noqa: F401
                            lora_dirs, make_adapter, peft, peft_model, peft_training)

from mpipar.checkpoint.huggingface import load_hf
from mpipar.checkpoint.peft import AdapterError, merge, read_adapter, save_adapter
from mpipar.config import Config, ConfigError, ModelConfig, TrainConfig
from mpipar.checkpoint.peft import PREFIX
from mpipar.model.lora import Lora, is_adapter
from mpipar.model.lora_dropout import keep_mask
from mpipar.rules import validate
from mpipar.training import step as trainer


def lora_of(**fields) -> Lora:
    return Lora.of(TrainConfig(**{**LORA_FIELDS, **fields}))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_training_matches_peft(lora_dirs, samples, float64_transformers, recompute):
    base, adapter = lora_dirs
    cfg, params = load_hf(base)
    adapters = read_adapter(adapter, cfg, lora_of())
    rank = mpipar_rank(cfg, {**params, **adapters}, samples,
                           train_fields={**LORA_FIELDS, "recompute": recompute})
    # Only the adapters have gradients and optimizer state.
    trained_names = set(rank.weights.reducer.master_tensors())
    assert trained_names == set(adapters) and all(is_adapter(n) for n in trained_names)
    assert set(rank.weights.frozen.local_shapes()) == set(params)
    assert {name for _, name, *_ in rank.weights.optimizer.state()} == set(adapters)
    results = [trainer.train_step(rank, k) for k in range(LORA_STEPS)]
    trained = trainer.gather_params(rank)
    losses, norms, want = peft_training(base, adapter, samples)

    assert norms[0] > OPT["clip_grad"]                        # clipping is exercised
    for r, loss, norm in zip(results, losses, norms):
        assert abs(r.loss - loss) <= TOL * loss, (r.loss, loss)
        assert abs(r.grad_norm - norm) <= TOL * norm, (r.grad_norm, norm)
    assert max(rel(trained[n], want[n]) for n in want) <= TOL
    assert max(rel(trained[n], adapters[n]) for n in want) > 1e-3     # the adapters moved
    for n, v in params.items():                                       # the base did not
        np.testing.assert_array_equal(trained[n], v)


DROPOUT = 0.3


def test_dropout_matches_peft_fed_the_same_mask(lora_dirs, samples, float64_transformers):
    """--lora-dropout: PEFT's ``B(A(dropout(x))) * s`` with the base reading ``x``, inverted
    scaling, training only; float64 against PyTorch + PEFT whose dropout layers multiply by
    mpipar's mask, under full recompute (the recomputed forward draws the forward's mask)."""
    base, adapter = lora_dirs
    cfg, params = load_hf(base)
    fields = {**LORA_FIELDS, "lora_dropout": DROPOUT, "recompute": "full"}
    adapters = read_adapter(adapter, cfg, lora_of())
    rank = mpipar_rank(cfg, {**params, **adapters}, samples, train_fields=fields)
    results = [trainer.train_step(rank, k) for k in range(LORA_STEPS)]
    trained = trainer.gather_params(rank)
    losses, norms, want = peft_training(base, adapter, samples, DROPOUT)
    plain, _, _ = peft_training(base, adapter, samples)
    assert min(abs(a - b) / b for a, b in zip(losses, plain)) > 1e-3     # dropout acts
    for r, loss, norm in zip(results, losses, norms):
        assert abs(r.loss - loss) <= TOL * loss, (r.loss, loss)
        assert abs(r.grad_norm - norm) <= TOL * norm, (r.grad_norm, norm)
    assert max(rel(trained[n], want[n]) for n in want) <= TOL
    # Not in training: nothing dropped (a forward outside a step equals PEFT's eval mode).
    rows = np.load(samples)[:2]
    _, cache = rank.model.chunks[0].forward(rank.params, rows[:, :-1], rank.model.positions,
                                            rows[:, 1:])
    model = peft_model(base, adapter)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data.copy_(torch.from_numpy(trained[n.removeprefix(PREFIX).replace(".default",
                                                                             "")]))
    model.eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(rows[:, :-1])).logits.numpy()
    assert rel(cache.head.logits.reshape(2, S, -1), theirs) <= TOL


def test_dropout_mask_is_a_function_of_the_place():
    """The mask keeps 1 - p of the elements, and any part of it (a rank's columns or tokens) is
    that part of the whole mask; another step, layer or target draws another."""
    tokens, width, p = np.arange(40) * 7 + 3, 512, 0.25
    whole = keep_mask(np, p, (5, 2, 1, 3), tokens, range(width), width)
    assert abs(whole.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / whole.size)
    part = keep_mask(np, p, (5, 2, 1, 3), tokens[10:30], range(128, 256), width)
    np.testing.assert_array_equal(part, whole[10:30, 128:256])
    for key in [(5, 3, 1, 3), (5, 2, 0, 3), (5, 2, 1, 4), (6, 2, 1, 3)]:
        other = keep_mask(np, p, key, tokens, range(width), width)
        assert 0.3 < (other != whole).mean() < 0.45      # 2 p (1 - p) = 0.375


def test_export_loads_in_peft_and_merge_equals_merge_and_unload(lora_dirs, samples,
                                                                  float64_transformers,
                                                                  tmp_path):
    base, adapter = lora_dirs
    cfg, params = load_hf(base)
    lora = lora_of()
    adapters = read_adapter(adapter, cfg, lora)
    rank = mpipar_rank(cfg, {**params, **adapters}, samples, train_fields=LORA_FIELDS)
    trainer.train_step(rank, 0)
    trained = trainer.gather_params(rank)
    save_adapter(tmp_path / "out", cfg, lora, trained, base=str(base))
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (RANK, ALPHA)

    model = peft_model(base, tmp_path / "out")
    loaded = adapter_tensors(model)
    assert sorted(loaded) == sorted(n for n in trained if is_adapter(n))
    for n, v in loaded.items():
        np.testing.assert_array_equal(v, trained[n])
    rows = np.load(samples)[:2]
    stage = rank.model.chunks[0]
    loss, cache = stage.forward(rank.params, rows[:, :-1], rank.model.positions, rows[:, 1:])
    ours = cache.head.logits.reshape(2, S, -1)
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(rows[:, :-1])).logits.numpy()
        merged = model.merge_and_unload().state_dict()
    assert rel(ours, theirs) <= TOL
    ours_merged = merge(cfg, lora, trained)
    assert max(rel(ours_merged[n], merged["model." + n if n != "lm_head.weight" else n])
               for n in ours_merged) <= TOL


def test_rslora_scale(lora_dirs, tmp_path):
    base, _ = lora_dirs
    cfg, _ = load_hf(base)
    adapter = make_adapter(base, tmp_path, rslora=True)
    assert lora_of(lora_rslora=True).scale == ALPHA / np.sqrt(RANK)
    with pytest.raises(AdapterError, match="use_rslora"):
        read_adapter(adapter, cfg, lora_of())
    assert read_adapter(adapter, cfg, lora_of(lora_rslora=True))


@pytest.mark.parametrize("edit, match", [
    ({"lora_alpha": 8.0}, "lora_alpha=8.0"),
    ({"r": 2}, "r=2"),
    ({"target_modules": ["q_proj", "v_proj"]}, "target_modules"),
    ({"lora_alpha": None}, "lora_alpha"),
])
def test_adapter_config_refused(lora_dirs, tmp_path, edit, match):
    base, adapter = lora_dirs
    cfg, _ = load_hf(base)
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((adapter / "adapter_config.json").read_text())
    for k, v in edit.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    (bad / "adapter_config.json").write_text(json.dumps(raw))
    (bad / "adapter_model.safetensors").write_bytes(
        (adapter / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=match):
        read_adapter(bad, cfg, lora_of())


def test_adapter_of_another_model_refused(lora_dirs):
    base, adapter = lora_dirs
    cfg, _ = load_hf(base)
    smaller = ModelConfig(**{**cfg.__dict__, "layers": 1})
    with pytest.raises(AdapterError, match="unexpected"):
        read_adapter(adapter, smaller, lora_of())


@pytest.mark.parametrize("fields, match", [
    ({"lora_rank": -1}, r"train.lora_rank=-1: must be >= 0"),
    ({"lora_targets": "q_proj,qkv"}, r"'qkv' is not a target"),
    ({"lora_rank": 9}, r"train.lora_rank=9: must be <= 8"),
    ({"lora_dropout": 1.0}, r"lora_dropout=1.0: must be in \[0, 1\)"),
    ({"lora_dropout": 0.1, "lora_rank": 0}, r"lora_dropout=0.1: needs --lora-rank > 0"),
    ({"lora_alpha": 0.0}, r"lora_alpha=0.0: must be > 0"),
    ({"optimizer": "muon"}, r"train.optimizer='muon' with train.lora_rank=4: .*low-rank "
                            r"factors A and B.*--optimizer adamw"),
    ({"on_rank_failure": "shrink", "init_from_hf": "base"},
     r"train.on_rank_failure='shrink' with train.lora_rank=4 and train.init_from_hf='base': "
     r".*not the frozen base"),
])
def test_rules(fields, match):
    """LoRA's own rules, and the combinations refused: Muon would orthogonalise the low-rank
    factors, and a shrink's recovery would rebuild a frozen base from the seed, not the file."""
    model = ModelConfig(vocab_size=64, hidden=16, layers=2, heads=2, kv_heads=1, ffn_hidden=32)
    train = TrainConfig(seq_len=8, global_batch_size=2, **{**LORA_FIELDS, **fields})
    with pytest.raises(ConfigError, match=match):
        validate(Config(model=model, train=train), 1)


@pytest.mark.parametrize("fields", [{"optimizer": "muon"},
                                    {"on_rank_failure": "shrink", "init_from_hf": "base"}])
def test_combinations_allowed_without_lora(fields):
    """The refused combinations are LoRA's: without --lora-rank (or, for a shrink, without
    --init-from-hf) the same flags validate."""
    model = ModelConfig(vocab_size=64, hidden=16, layers=2, heads=2, kv_heads=1, ffn_hidden=32)
    validate(Config(model=model, train=TrainConfig(seq_len=8, global_batch_size=2, **fields)), 1)
    lora_shrink = {**LORA_FIELDS, "on_rank_failure": "shrink"}
    validate(Config(model=model, train=TrainConfig(seq_len=8, global_batch_size=2,
                                                   **lora_shrink)), 1)


def test_merge_adapter_command_equals_merge_and_unload(lora_dirs, samples, float64_transformers,
                                                       tmp_path, capsys):
    """``python -m mpipar.ckpt merge-adapter`` of a LoRA run's checkpoint (the adapters alone)
    with the run's --init-from-hf base equals PEFT's ``merge_and_unload()`` of the base and the
    run's exported adapter, in float64; bad input exits 2 naming it, nothing written."""
    import subprocess
    import sys

    from conftest import launch_env
    from mpipar.checkpoint.cli import main as ckpt
    base, adapter = lora_dirs
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LORA_FIELDS.items()]
    run = subprocess.run(
        [sys.executable, "-m", "mpipar.train", *flags, "--seq-len", str(S),
         "--global-batch-size", "2", "--steps", "1", "--backend", "numpy", "--dtype",
         "float64", "--log-every", "0", "--data", str(samples), "--init-from-hf", str(base),
         "--init-adapter", str(adapter), "--run-dir", str(tmp_path / "run"), "--save-dir",
         str(tmp_path / "ck"), "--export-adapter", str(tmp_path / "trained")],
        capture_output=True, text=True, timeout=600, env=launch_env())
    assert run.returncode == 0, run.stderr
    assert ckpt(["merge-adapter", str(tmp_path / "ck"), "--out", str(tmp_path / "m")]) == 0
    _, ours = load_hf(tmp_path / "m")
    with torch.no_grad():
        theirs = peft_model(base, tmp_path / "trained").merge_and_unload().state_dict()
    assert sorted(ours) == sorted(n.removeprefix("model.") for n in theirs)
    assert max(rel(v, theirs["model." + n if n != "lm_head.weight" else n].numpy())
               for n, v in ours.items()) <= TOL
    # python -m mpipar.generate on the LoRA run's checkpoint is the merged model's
    (ids, logits), (want_ids, want) = _generated(tmp_path / "ck"), _generated(tmp_path / "m")
    assert ids == want_ids and rel(logits, want) <= TOL
    capsys.readouterr()
    for args, match in [([str(tmp_path / "run")], "index.h5: missing"),
                        ([str(tmp_path / "ck"), "--base", str(adapter)], "config.json")]:
        assert ckpt(["merge-adapter", *args, "--out", str(tmp_path / "bad")]) == 2
        assert match in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()


def _generated(model) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after a fixed prompt and the logits each was picked from, in float64, of
    a model ``python -m mpipar.generate`` reads (an mpipar checkpoint or a Hugging Face
    directory), loaded as it loads them."""
    from mpi4py import MPI
    from mpipar import generate
    from mpipar.config import ParallelConfig
    from mpipar.inference.generator import Generator
    from mpipar.inference.sampling import Sampling
    model_cfg, _, kind = generate.read_model(str(model))
    cfg = validate(Config(model_cfg, ParallelConfig(), TrainConfig(
        seq_len=1, global_batch_size=1, micro_batch_size=1, dtype="float64",
        backend="numpy")), 1)
    generator = Generator(cfg, MPI.COMM_SELF)
    generate._load(generator, str(model), kind, MPI.COMM_SELF)
    out = generator.generate([3, 1, 4], 3, Sampling(temperature=0.0), keep_logits=True)
    generator.close()
    return out.ids, np.stack([np.asarray(v) for v in out.logits])
