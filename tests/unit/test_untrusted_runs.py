"""Runs that must stop before they start, and never lose what an earlier run wrote: generation
that would not fit in memory or whose checkpoint's tensors disagree with its config, a prompt
that is not text, a Hugging Face export that cannot be written, a run directory or save
directory holding another run's outputs, and run directories whose files ``mpipar.report``
cannot read. Each test asserts the exit status, one message, no traceback, and that nothing
was lost or written. The programs run in this process on one rank (:mod:`untrusted`: the
refusals come before any collective); e2e/test_untrusted_runs.py shows on a launched two-rank
run that every rank exits 2 and one prints."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from layouts import small_config, token_source
from mpipar import report
from mpipar.checkpoint import directory, reader, writer
from mpipar.rules import validate
from mpipar.runtime.comm import Group, Ledger
from untrusted import RUN, TINY, earlier_run, run_generate, run_train, snapshot


def _checkpoint(save_dir, step: int = 0, **model) -> str:
    """A one-process checkpoint of step ``step`` of the layouts test model (byte vocabulary)."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    cfg = small_config()
    cfg.model.vocab_size = 256
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg = validate(cfg, 1)
    rank = build_rank(cfg, MPI.COMM_SELF, source=token_source())
    return str(writer.save(rank.state, trainer.run_position(rank, step), save_dir,
                               Group(MPI.COMM_SELF, "world", Ledger())))


def _one_error(code, err, message) -> None:
    assert code == 2, err
    assert err.count("mpipar: error:") == 1 and message in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint generation can read (byte vocabulary, float64)."""
    return _checkpoint(tmp_path_factory.mktemp("gen") / "ckpt")


def _with_config(src: str, dst, old: str, new: str) -> str:
    """A copy of checkpoint ``src`` whose stored config says ``new`` where it said ``old``, its
    index's sha256 rewritten to match (as whoever crafted it would)."""
    shutil.copytree(src, dst)
    index = os.path.join(dst, directory.INDEX)
    with h5py.File(index, "r+") as f:
        text = str(f.attrs["config_toml"])
        assert old in text
        f.attrs["config_toml"] = text.replace(old, new)
    with open(index, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    with open(os.path.join(dst, directory.INDEX_SUM), "w") as fh:
        fh.write(f"{digest}  {directory.INDEX}\n")
    return str(dst)


# ----------------------------------------------------------------------- generate: memory
def test_generation_beyond_memory_is_refused_at_once(saved):
    """``--max-new-tokens 1000000000000`` is refused at once: the KV cache of the prompt and the
    new tokens, with the weights, is checked against the available memory first: exit 2
    naming both numbers, within seconds."""
    started = time.perf_counter()
    code, err = run_generate([saved, "--prompt", "hi", "--max-new-tokens", "1000000000000",
                              "--backend", "numpy"])
    _one_error(code, err, "the busiest rank needs at least")
    assert "KV cache of 1,000,000,000,002 positions" in err and "bytes available" in err
    assert time.perf_counter() - started < 30
    assert reader.verify(saved) == []


def test_a_config_claiming_a_huge_model_is_refused_before_allocating(saved, tmp_path):
    """A checkpoint whose config claims 10^8 layers is refused before anything is allocated: the
    memory bound is computed from the sizes alone, exit 2 within seconds."""
    huge = _with_config(saved, tmp_path / "huge", "layers = 4", "layers = 100000000")
    started = time.perf_counter()
    code, err = run_generate([huge, "--prompt", "hi", "--backend", "numpy"])
    _one_error(code, err, "the busiest rank needs at least")
    # told to start anyway, the tensors it stores are counted before the config's are listed
    code, err = run_generate([huge, "--prompt", "hi", "--backend", "numpy",
                              "--allow-oversubscribed-memory"])
    _one_error(code, err, f"{huge}: its config claims 100,000,000 layers, but it stores 39 "
                          f"parameter tensors")
    assert time.perf_counter() - started < 30


def test_stored_shapes_that_disagree_with_the_config_are_refused(saved, tmp_path):
    """The stored tensors' shapes are checked against the config (metadata only) before
    anything is allocated: a config that says hidden 64 over tensors of 32 is named."""
    wide = _with_config(saved, tmp_path / "wide", "hidden = 32", "hidden = 64")
    code, err = run_generate([wide, "--prompt", "hi", "--backend", "numpy"])
    _one_error(code, err, "param/embed_tokens.weight has shape [256, 32], but the checkpoint's "
                          "config implies [256, 64]")


def test_a_hugging_face_config_claiming_more_layers_than_stored_is_refused(tmp_path):
    from mpipar.checkpoint.huggingface import CONFIG_FILE, save_hf
    from mpipar.model.params import init_params
    cfg = small_config()
    cfg.model.vocab_size = 256
    model = validate(cfg, 1).model
    save_hf(tmp_path / "hf", model, init_params(model, 1, np.float32))
    raw = json.loads((tmp_path / "hf" / CONFIG_FILE).read_text())
    (tmp_path / "hf" / CONFIG_FILE).write_text(json.dumps({**raw, "num_hidden_layers": 6}))
    code, err = run_generate([str(tmp_path / "hf"), "--prompt", "hi", "--backend", "numpy"])
    _one_error(code, err, "18 missing tensor(s) for a LlamaForCausalLM with 6 layers")


# ------------------------------------------------------------------ generate: the prompt
def test_a_prompt_that_is_not_utf8_is_named(saved, tmp_path):
    """A prompt that is not UTF-8 with ``--tokenizer`` (an argument's bytes reach Python as lone
    surrogates) is refused by both codecs naming the byte."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"</s>": 0, "x": 1}, unk_token="x"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # latin-1 bytes on a UTF-8 system
    for extra in ([], ["--tokenizer", str(tmp_path)]):
        code, err = run_generate([saved, "--prompt", prompt, "--backend", "numpy", *extra])
        _one_error(code, err, "--prompt is not UTF-8 text: the byte 0xe9 at character 3")


# ----------------------------------------------------------------- train: export before step 1
@pytest.mark.parametrize("model", [["--sliding-window", "4", "--window-layers", "even"],
                                   ["--attention-bias", "--sliding-window", "4"]])
def test_a_model_that_cannot_be_exported_is_refused_before_step_1(tmp_path, model):
    """``--export-hf`` of a model with no Hugging Face architecture (a window on some layers, or
    a window with biases) exits 2 before step 1, nothing trained or written."""
    code, err = run_train([*TINY, *model, "--export-hf", str(tmp_path / "hf"), "--run-dir",
                           str(tmp_path / "run")])
    _one_error(code, err, f"--export-hf {tmp_path / 'hf'}: model.sliding_window=4 with "
                          f"window_layers=")
    assert "can be exported" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert directory.list_checkpoints(tmp_path / "run" / "checkpoints") == []


# ----------------------------------------------------------- train: an earlier run's outputs
def test_a_fresh_run_keeps_an_earlier_runs_metrics(tmp_path):
    """A fresh run in a ``--run-dir`` whose earlier run saved elsewhere (``--save-dir``) exits 2
    naming the run directory and the steps it holds; every file (metrics.jsonl, config,
    summaries) stays unchanged."""
    run = tmp_path / "run"
    earlier_run(run)
    before = snapshot(run)
    code, err = run_train([*TINY, "--run-dir", str(run), "--save-dir", str(tmp_path / "ck")])
    _one_error(code, err, f"--run-dir {run} holds the metrics of an earlier run (50 step(s), the "
                          f"last step 50)")
    assert snapshot(run) == before


def test_resume_auto_over_only_damaged_checkpoints_keeps_them(tmp_path):
    """``--resume auto`` whose only checkpoint fails verification exits 2 naming the checkpoint
    and why it failed (rather than starting fresh over it); the damaged checkpoint and the
    metrics stay as they were."""
    run = tmp_path / "run"
    earlier_run(run)
    step = _checkpoint(run / "checkpoints", 50)
    shard = os.path.join(step, "shard_00000.h5")
    with open(shard, "r+b") as fh:
        fh.seek(os.path.getsize(shard) // 2)
        fh.write(b"\xff" * 64)
    before = snapshot(run)
    code, err = run_train([*TINY, "--run-dir", str(run), "--resume", "auto"])
    _one_error(code, err, f"--resume auto: no checkpoint of --save-dir {run / 'checkpoints'} "
                          f"verifies")
    assert "step_00000050" in err and "move them aside" in err
    assert snapshot(run) == before


def test_a_run_resumed_from_elsewhere_keeps_this_save_directorys_checkpoints(tmp_path):
    """A run resumed from another run's checkpoint into a save directory holding checkpoints
    would save its steps over them (another lineage's step directories): exit 2."""
    other = _checkpoint(tmp_path / "other", 1)
    mine = tmp_path / "run" / "checkpoints"
    _checkpoint(mine, 2)
    before = snapshot(mine)
    code, err = run_train([*RUN, "--run-dir", str(tmp_path / "run"), "--resume", other])
    _one_error(code, err, f"--save-dir {mine} holds checkpoints of another run (newest "
                          f"step_00000002); a run resumed from {other} would save its steps "
                          f"over them")
    assert snapshot(mine) == before


def test_a_metrics_log_that_cannot_be_read_back_is_refused_before_step_1(tmp_path):
    """A resumed run keeps the metrics of the steps it continues; a metrics.jsonl it cannot
    read (a line that is not a step record) is an error before step 1, not a traceback at the
    first record."""
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", 1)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n[1, 2, 3]\n{"step": 3}\n')
    code, err = run_train([*RUN, "--run-dir", str(run), "--resume", "auto"])
    _one_error(code, err, f"{run / 'metrics.jsonl'}: line 2 is not a step record")
    assert (run / "metrics.jsonl").read_text().count("\n") == 3


# --------------------------------------------------------------------------------- report
GOOD = {"step": 1, "loss": 5.0, "step_time_s": 0.1, "tokens_per_s": 100.0, "mfu": 0.01,
        "time": dict.fromkeys(("compute", "tp_comm", "sp_comm", "pipeline_wait", "dp_comm",
                               "optimizer", "io"), 0.01)}


@pytest.mark.parametrize("lines,timeline,message", [
    (['{"step": 4}'], None, "metrics.jsonl: step 4: loss=None is not what a step record holds"),
    (["[1,2,3]", json.dumps(GOOD)], None, "metrics.jsonl: line 1 is not a step record"),
    (['{"step": "four"}', json.dumps(GOOD)], None, "line 1 is not a step record"),
    ([json.dumps({**GOOD, "time": {"compute": "x"}})], None, "step 1: time={'compute': 'x'}"),
    ([json.dumps(GOOD)], {"ranks": 5}, "timeline.json: must be an object with an integer 'step'"),
    ([json.dumps(GOOD)], {"step": 1, "ranks": [{"rank": 0, "ops": [[1]]}]},
     "timeline.json: ranks[0] must be an object"),
], ids=["no-loss", "a-list", "step-four", "time-string", "ranks-5", "bad-ops"])
def test_report_refuses_malformed_records(tmp_path, capsys, lines, timeline, message):
    """``mpipar.report`` names each parseable but malformed record and timeline (file, step or
    line, field): exit 2, one line, no report written."""
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if timeline is not None:
        (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "report").exists()


def test_report_refuses_a_config_whose_sizes_are_not_sizes(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "config.toml").write_text('[parallel]\ndp = 0\npp = "two"\n')
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"mpipar.report: error: {tmp_path / 'config.toml'}: parallel.dp=0 must "
                           f"be an integer >= 1")


# ------------------------------------------------- train: --resume auto before any checkpoint
def _requeued(run, *extra: str) -> tuple[int, str, str]:
    """``python -m mpipar.train --resume auto`` in ``run``, as a requeued job starts it:
    (status, stdout, stderr)."""
    import subprocess
    import sys

    from conftest import launch_env
    done = subprocess.run([sys.executable, "-m", "mpipar.train", *TINY, "--run-dir", str(run),
                           "--resume", "auto", *extra], env=launch_env(), capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("interrupted", [False, True])
def test_resume_auto_before_the_first_checkpoint_starts_again(tmp_path, interrupted):
    """A run killed before its first checkpoint (or while an asynchronous save wrote it: a
    hidden ``.step_N.tmp`` is all it left) and requeued with ``--resume auto`` begins again,
    says so, and keeps the earlier metrics whole as ``metrics.jsonl.1``; a second requeue of
    the same kind keeps both earlier logs."""
    run = tmp_path / "run"
    earlier_run(run, steps=2)
    if interrupted:
        partial = run / "checkpoints" / ".step_00000002.tmp"
        partial.mkdir(parents=True)
        (partial / "shard_00000.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    earlier = (run / "metrics.jsonl").read_bytes()
    code, out, err = _requeued(run, "--steps", "1")
    assert code == 0 and "Traceback" not in err, err
    assert (f"--resume auto: no committed checkpoint in {run / 'checkpoints'}; starting the run "
            f"again from step 1; the earlier run's metrics.jsonl is kept as metrics.jsonl.1") in out
    assert (run / "metrics.jsonl.1").read_bytes() == earlier
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1]
    shutil.rmtree(run / "checkpoints")  # as if the first requeue was killed before saving too
    first = (run / "metrics.jsonl").read_bytes()
    code, out, err = _requeued(run, "--steps", "1")
    assert code == 0 and "kept as metrics.jsonl.2" in out, err
    assert (run / "metrics.jsonl.1").read_bytes() == earlier
    assert (run / "metrics.jsonl.2").read_bytes() == first


# ------------------------------------------------- ckpt: converters check before allocating
@pytest.mark.parametrize("command", ["consolidate", "export-hf"])
def test_converters_compare_tensor_shapes_with_the_config(saved, tmp_path, capsys, command):
    """``ckpt consolidate`` and ``export-hf`` check the stored shapes against the config before
    reading a tensor: a config of hidden 64 over tensors of 32 is named, nothing written."""
    from mpipar import ckpt
    wide = _with_config(saved, tmp_path / "wide", "hidden = 32", "hidden = 64")
    out = tmp_path / "out"
    assert ckpt.main([command, wide, str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert ("param/embed_tokens.weight has shape [256, 32], but the checkpoint's config implies "
            "[256, 64]") in err and not out.exists()


@pytest.mark.parametrize("command,what", [("consolidate", "its largest tensor"),
                                          ("export-hf", "its parameters")])
def test_converters_check_memory_before_allocating(saved, tmp_path, capsys, monkeypatch,
                                                   command, what):
    """A tensor larger than the memory this node has is refused before it is allocated."""
    from mpipar import ckpt
    from mpipar.runtime import host_memory
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 4096)
    out = tmp_path / "out"
    assert ckpt.main([command, saved, str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"({what}) needs" in err and "GiB of memory at once; this node has 0.00 GiB" in err
    assert not out.exists()


# --------------------------------------------------- a symlinked step_N in a save directory
@pytest.fixture
def linked_step(tmp_path):
    """A save directory holding step_00000001 and a symbolic link step_00000002 to a checkpoint
    elsewhere, which ``latest`` names: (save directory, the link's target)."""
    save = tmp_path / "run" / "checkpoints"
    _checkpoint(save, 1)
    elsewhere = _checkpoint(tmp_path / "elsewhere", 2)
    os.symlink(elsewhere, save / "step_00000002")
    (save / "latest").write_text("step_00000002\n")
    return save, elsewhere


@pytest.mark.parametrize("argv", [["verify", "{link}"], ["verify", "{save}"],
                                  ["inspect", "{link}"], ["consolidate", "{link}", "{out}"],
                                  ["export-hf", "{save}", "{out}"]])
def test_a_symlinked_checkpoint_directory_is_not_read(linked_step, tmp_path, capsys, argv):
    from mpipar import ckpt
    save, elsewhere = linked_step
    names = {"link": str(save / "step_00000002"), "save": str(save), "out": str(tmp_path / "o")}
    assert ckpt.main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (f"{save / 'step_00000002'}: a symbolic link (to {elsewhere}); a checkpoint directory "
            f"must lie inside its save directory") in err
    assert not (tmp_path / "o").exists()


def test_resume_and_pruning_pass_a_symlinked_checkpoint_directory_by(linked_step, tmp_path):
    """``--resume auto`` takes the save directory's own checkpoint, not the link ``latest``
    names; its save of step 2 replaces the link (not the link's target), and ``--keep-last 1``
    prunes only its own checkpoints."""
    save, elsewhere = linked_step
    before = snapshot(elsewhere)
    code, err = run_train([*RUN, "--run-dir", str(tmp_path / "run"), "--resume", "auto",
                           "--keep-last", "1", "--save-every", "1"])
    assert code == 0 and "Traceback" not in err, err
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000003"]
    assert snapshot(elsewhere) == before
    assert (save / "latest").read_text() == "step_00000003\n"


# ------------------------------------------------ train: run directories no filesystem holds
def test_a_nul_in_a_toml_path_is_refused(tmp_path):
    config = tmp_path / "nul.toml"
    config.write_text(f'[train]\nrun_dir = "{tmp_path}/a\\u0000b"\n')
    code, err = run_train([*TINY, "--config", str(config)])
    _one_error(code, err, "train.run_dir=")
    assert "must not contain a NUL character" in err
    assert sorted(os.listdir(tmp_path)) == ["nul.toml"]


def test_a_run_directory_name_longer_than_the_filesystem_holds_is_refused(tmp_path):
    run = tmp_path / ("r" * 300)
    code, err = run_train([*TINY, "--run-dir", str(run)])
    _one_error(code, err, f"--run-dir {run}: cannot create the directory (File name too long")
