"""LoRA through python -m mpipar.train (no torch needed): a base from --init-from-hf and a PEFT
adapter from --init-adapter; the adapter exported in PEFT's format and the merged model as a
Hugging Face directory; a checkpointed run resumed equals the uninterrupted one bit for bit; a
checkpoint holds the adapters alone and `ckpt merge-adapter` of it equals the run's own merged
export; an adapter that does not fit, or LoRA with Muon, exits 2 naming it."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from conftest import launch_env
from hf_export import MODEL, export_small_model
from mpipar.checkpoint.huggingface import load_hf
from mpipar.checkpoint.peft import merge, read_adapter, save_adapter
from mpipar.checkpoint.reader import read_tensors
from mpipar.config import TrainConfig
from mpipar.model.lora import Lora
from mpipar.model.params import param_specs

LORA = ["--lora-rank", "4", "--lora-alpha", "6", "--lora-targets", "q_proj,v_proj,down_proj"]
TRAIN = ["--seq-len", "8", "--global-batch-size", "2", "--backend", "numpy", "--log-every", "0",
         "--dtype", "float64", "--lr-schedule", "constant", "--warmup-steps", "0", "--lr", "0.01"]


def _lora() -> Lora:
    return Lora.of(TrainConfig(lora_rank=4, lora_alpha=6.0,
                               lora_targets="q_proj,v_proj,down_proj"))


def _train(tmp_path, run, *flags):
    return subprocess.run([sys.executable, "-m", "mpipar.train", *TRAIN, *LORA, "--data",
                           str(tmp_path / "data.npy"), "--init-from-hf", str(tmp_path / "hf"),
                           "--run-dir", str(tmp_path / run), *flags],
                          capture_output=True, text=True, timeout=300, env=launch_env())


def test_adapter_in_out_merge_and_resume(tmp_path):
    base = export_small_model(tmp_path / "hf")
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 61, size=(8, 9)))
    rng = np.random.default_rng(2)
    start = {s.name: rng.normal(0, 0.1, s.shape) for s in _adapter_specs()}
    save_adapter(tmp_path / "start", MODEL, _lora(), start)

    whole = _train(tmp_path, "whole", "--steps", "2", "--init-adapter", str(tmp_path / "start"),
                   "--export-adapter", str(tmp_path / "a"), "--export-hf", str(tmp_path / "m"))
    assert whole.returncode == 0, whole.stderr
    trained = read_adapter(tmp_path / "a", MODEL, _lora())
    assert max(np.abs(trained[n] - start[n]).max() for n in start) > 1e-4   # it trained
    # The merged export is the base (as read: float32) with W + s B A.
    _, merged = load_hf(tmp_path / "m")
    want = merge(MODEL, _lora(), {**{n: v.astype(np.float64) for n, v in base.items()},
                                  **trained})
    assert sorted(merged) == sorted(want)
    for n in want:
        np.testing.assert_allclose(merged[n], want[n], rtol=0, atol=1e-14)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"] \
        == ["q_proj", "v_proj", "down_proj"]

    first = _train(tmp_path, "part", "--steps", "1", "--init-adapter", str(tmp_path / "start"),
                   "--save-dir", str(tmp_path / "ck"), "--save-every", "1")
    assert first.returncode == 0, first.stderr
    names = sorted(read_tensors(next((tmp_path / "ck").glob("step_*"))))
    assert names == sorted(start), names           # the adapters alone, not the frozen base
    resumed = _train(tmp_path, "part", "--steps", "2", "--resume", "auto", "--save-dir",
                     str(tmp_path / "ck"), "--export-adapter", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    again = read_adapter(tmp_path / "b", MODEL, _lora())
    for n in trained:
        np.testing.assert_array_equal(again[n], trained[n])


def test_an_adapter_that_does_not_fit_exits_2(tmp_path):
    export_small_model(tmp_path / "hf")
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 61, size=(8, 9)))
    rng = np.random.default_rng(2)
    save_adapter(tmp_path / "start", MODEL, _lora(),
                 {s.name: rng.normal(0, 0.1, s.shape) for s in _adapter_specs()})
    config = tmp_path / "start" / "adapter_config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "lora_alpha": 16}))
    proc = _train(tmp_path, "bad", "--steps", "1", "--init-adapter", str(tmp_path / "start"))
    assert proc.returncode == 2 and "lora_alpha=16" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _adapter_specs():
    return [a for s in param_specs(MODEL) for a in _lora().specs(s)]


def test_merge_adapter_of_a_seed_base_run_equals_its_export_hf(tmp_path):
    """Without --init-from-hf the frozen base is the seed's initialisation: ``python -m
    mpipar.ckpt merge-adapter`` of the run's checkpoint makes it again and writes the model the
    run's own --export-hf wrote (float64, the same values)."""
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 61, size=(8, 9)))
    model = ["--vocab-size", "64", "--hidden", "16", "--layers", "2", "--heads", "2",
             "--kv-heads", "1", "--ffn-hidden", "32"]
    run = subprocess.run([sys.executable, "-m", "mpipar.train", *TRAIN, *LORA, *model, "--data",
                          str(tmp_path / "data.npy"), "--steps", "2", "--run-dir",
                          str(tmp_path / "run"), "--save-dir", str(tmp_path / "ck"),
                          "--export-hf", str(tmp_path / "exported")],
                         capture_output=True, text=True, timeout=300, env=launch_env())
    assert run.returncode == 0, run.stderr
    merge = subprocess.run([sys.executable, "-m", "mpipar.ckpt", "merge-adapter",
                            str(tmp_path / "ck"), "--out", str(tmp_path / "merged")],
                           capture_output=True, text=True, timeout=300, env=launch_env())
    assert merge.returncode == 0, merge.stderr
    _, exported = load_hf(tmp_path / "exported")
    _, merged = load_hf(tmp_path / "merged")
    assert sorted(merged) == sorted(exported)
    for n in exported:
        np.testing.assert_allclose(merged[n], exported[n], rtol=0, atol=1e-14)


def test_muon_with_lora_exits_2_naming_both_flags(tmp_path):
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 61, size=(8, 9)))
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", *TRAIN, *LORA, "--optimizer",
                           "muon", "--data", str(tmp_path / "data.npy"), "--steps", "1",
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=launch_env())
    assert proc.returncode == 2, proc.stderr
    assert "train.optimizer='muon' with train.lora_rank=4" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
