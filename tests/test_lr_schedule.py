"""The warmup-stable-decay (wsd) learning-rate schedule: every step against the formula for each
decay shape, its configuration rules, and extending a run from a stable-phase checkpoint."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import launch_env
from mpipar.checkpoint import reader
from mpipar.checkpoint.index import read_index
from mpipar.checkpoint.records import DataCursor, LRScheduleState, RankPlace, RunPosition
from mpipar.config import Config, ConfigError
from mpipar.rules import validate
from mpipar.train import resolve_config
from mpipar.training.optim import DECAY_SHAPES, LRSchedule

SHAPES = {"linear": lambda p: 1 - p,
          "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
          "sqrt": lambda p: 1 - math.sqrt(p)}
"""f(p), the fraction of (lr - min_lr) left at decay progress p, as the WSD papers write it."""


def reference(s: int, lr: float, min_lr: float, w: int, n: int, f: float, shape: str) -> float:
    """The wsd learning rate of 0-based step ``s``, computed from LRSchedule's docstring."""
    if s < w:
        return lr * (s + 1) / w
    start = max(w, n - max(1, math.floor(f * n + 0.5)))
    if s < start:
        return lr
    return min_lr + (lr - min_lr) * SHAPES[shape](min(1.0, (s + 1 - start) / max(1, n - start)))


CASES = [  # (lr, min_lr, warmup_steps, total_steps, decay_fraction, the first decaying step)
    (3e-3, 3e-4, 5, 100, 0.2, 80),     # 20 decay steps
    (1.0, 0.0, 0, 40, 0.25, 30),       # no warm-up, decay to 0
    (1.0, 0.1, 3, 37, 0.1, 33),        # 3.7 -> 4 decay steps
    (1.0, 0.1, 3, 30, 0.1, 27),        # 0.1 * 30 = 3.0000000000000004 -> 3 decay steps
    (2.0, 0.5, 4, 10, 1.0, 4),         # decay longer than the steps after warm-up: no stable phase
    (1.0, 0.0, 0, 1, 0.5, 0),          # one step: it decays, to min_lr
    (1.0, 0.2, 8, 6, 0.5, 8),          # warm-up longer than the run: no decay
]


@pytest.mark.parametrize("shape", sorted(DECAY_SHAPES))
@pytest.mark.parametrize("lr,min_lr,w,n,f,start", CASES)
def test_every_step_follows_the_formula(shape, lr, min_lr, w, n, f, start):
    s = LRSchedule("wsd", lr, min_lr, w, n, f, shape)
    got = [s(k) for k in range(n + 3)]
    assert got == pytest.approx([reference(k, lr, min_lr, w, n, f, shape)
                                 for k in range(n + 3)], rel=1e-15, abs=1e-15)
    assert s.decay_start == start
    assert all(x == lr for x in got[w:start])                     # the stable phase
    assert all(x < lr for x in got[start:n])                      # every decay step below lr
    assert all(a > b for a, b in zip(got[start:n], got[start + 1:n]))
    if n > w:
        assert got[n - 1] == pytest.approx(min_lr, abs=1e-15)    # the last step reaches min_lr


def test_the_shapes_at_a_glance():
    """Four decay steps from 1 to 0: progress 1/4, 1/2, 3/4, 1."""
    for shape, want in (("linear", [0.75, 0.5, 0.25, 0.0]),
                        ("cosine", [(1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0]),
                        ("sqrt", [0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0])):
        s = LRSchedule("wsd", 1.0, 0.0, 0, 8, 0.5, shape)
        assert [s(k) for k in range(8)] == pytest.approx([1.0] * 4 + want, abs=1e-15), shape


def test_a_longer_run_keeps_the_stable_phase_and_moves_the_decay():
    """Until the shorter run's decay begins, the learning rate does not depend on the steps:
    a checkpoint of the stable phase resumed with more steps is the longer run."""
    for shape in DECAY_SHAPES:
        short, long = (LRSchedule("wsd", 1.0, 0.1, 3, n, 0.25, shape) for n in (20, 40))
        assert (short.decay_start, long.decay_start) == (15, 30)
        assert [short(k) for k in range(15)] == [long(k) for k in range(15)]
        assert [long(k) for k in range(3, 30)] == [1.0] * 27
        assert all(long(k) < 1.0 for k in range(30, 40)) and long(39) == pytest.approx(0.1)


def test_the_other_schedules_are_unchanged():
    cosine = LRSchedule("cosine", 1.0, 0.0, 0, 4)
    assert [cosine(k) for k in range(5)] == pytest.approx(
        [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0], abs=1e-15)
    assert [LRSchedule("constant", 0.3, 0.0, 4)(k) for k in (0, 3, 9)] == pytest.approx(
        [0.075, 0.3, 0.3])


# ------------------------------------------------------------------------------ the rules
RULES = [
    (["--lr-schedule", "wsd"], "train.decay_fraction=0.0: the wsd schedule needs the fraction "
     "of the steps that decays, in (0, 1]"),
    (["--lr-schedule", "wsd", "--decay-fraction", "1.5"], "train.decay_fraction=1.5: the wsd "
     "schedule needs"),
    (["--lr-schedule", "wsd", "--decay-fraction", "-0.1"], "train.decay_fraction=-0.1: the wsd "
     "schedule needs"),
    (["--decay-fraction", "0.2"], "train.decay_fraction=0.2: only with the wsd schedule (the "
     "schedule is 'cosine')"),
    (["--lr-schedule", "constant", "--decay-shape", "sqrt"], "train.decay_shape='sqrt': only "
     "with the wsd schedule (the schedule is 'constant')"),
    (["--lr-schedule", "wsd", "--decay-fraction", "nan"], "train.decay_fraction=nan: must be a "
     "finite number"),
    (["--lr-schedule", "wsd", "--decay-fraction", "0.2", "--decay-shape", "exp"],
     "argument --decay-shape: invalid choice: 'exp'"),
    (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
]


@pytest.mark.parametrize("flags,message", RULES, ids=[r[1][:40] for r in RULES])
def test_each_rule_exits_2_with_one_message(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        resolve_config(flags, 1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count(message) == 1, err


def test_the_rules_from_a_config_file_and_the_component():
    """A TOML value outside the flags' choices is the fields' rule; the schedule refuses the
    rest itself (ConfigError from the validation, ValueError from LRSchedule)."""
    cfg = Config.from_dict({"train": {"lr_schedule": "wsd", "decay_fraction": 0.3,
                                      "decay_shape": "exp"}})
    with pytest.raises(ConfigError, match="train.decay_shape='exp': must be one of linear, "
                                          "cosine, sqrt"):
        validate(cfg, 1)
    cfg.train.decay_shape, cfg.train.decay_fraction = "sqrt", 0.0
    with pytest.raises(ConfigError, match=r"^train.decay_fraction=0.0: the wsd schedule needs"):
        validate(cfg, 1)
    cfg.train.decay_fraction = 1.0
    assert validate(cfg, 1).train.decay_shape == "sqrt"
    with pytest.raises(ValueError, match=r"kind='step': must be 'constant' or 'cosine' or 'wsd'"):
        LRSchedule("step", 1.0)
    with pytest.raises(ValueError, match=r"decay_shape='exp': must be one of linear, cosine, sqrt"):
        LRSchedule("wsd", 1.0, decay_fraction=0.5, decay_shape="exp")


# ------------------------------------------------------------------------------ extension
MODEL = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "16",
         "--global-batch-size", "4", "--backend", "numpy", "--log-every", "0", "--dtype",
         "float64", "--lr-schedule", "wsd", "--decay-fraction", "0.25", "--decay-shape", "sqrt",
         "--warmup-steps", "3", "--tensorboard", "off"]


def _train(run_dir, *flags: str, data: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", *MODEL, "--data", data,
                           "--run-dir", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=240, env=launch_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_resuming_a_stable_phase_checkpoint_with_more_steps_extends_the_run(tmp_path):
    """A 20-step run saved at step 10 (stable phase: its decay starts at step 16), resumed with
    --steps 40: steps 11-30 at the peak as in a 40-step run, steps 31-40 (the last 0.25 * 40)
    decaying to min_lr; every step's learning rate is the 40-step schedule's, the resume note
    says this is how a wsd run is extended, and the checkpoint records the schedule. The
    20-step run's own end (saved in its decay) is past the point where extending is exact:
    the note for it says so."""
    data = tmp_path / "samples.npy"
    np.save(data, np.random.default_rng(3).integers(0, 256, size=(64, 17)))
    ck = tmp_path / "ck"
    _train(tmp_path / "a", "--steps", "20", "--save-dir", str(ck), "--save-every", "10",
           data=str(data))
    stable = ck / "step_00000010"
    recorded = read_index(stable).groups["lr_schedule"]
    assert {k: recorded[k] for k in ("kind", "decay_fraction", "decay_shape", "decay_start",
                                     "total_steps", "next_step")} == {
        "kind": "wsd", "decay_fraction": 0.25, "decay_shape": "sqrt", "decay_start": 15,
        "total_steps": 20, "next_step": 10}
    proc = _train(tmp_path / "b", "--steps", "40", "--save-dir", str(tmp_path / "ck_b"),
                  "--resume", str(stable), data=str(data))
    notes = [line for line in proc.stdout.splitlines() if "train.steps" in line]
    assert notes == ["mpipar: train.steps is 40, the checkpoint's run used 20: the checkpoint is "
                     "in the wsd schedule's stable phase, so every step's learning rate is that "
                     "of a run started with 40 steps: stable to step 30, decaying to min_lr over "
                     "steps 31-40 (the expected way to extend a wsd run)"], proc.stdout
    lr, min_lr = 3e-3, 3e-4  # the defaults
    longer = LRSchedule("wsd", lr, min_lr, 3, 40, 0.25, "sqrt")
    first, resumed = _metrics(tmp_path / "a")[:10], _metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == list(range(11, 41))
    assert [r["lr"] for r in first + resumed] == [longer(k) for k in range(40)]
    assert [r["lr"] for r in resumed[:20]] == [lr] * 20                        # steps 11-30
    assert all(r["lr"] < lr for r in resumed[20:]) and resumed[-1]["lr"] == pytest.approx(min_lr)

    decayed = ck / "step_00000020"  # the 20-step run's end, in its decay
    then = read_index(decayed)
    train = dataclasses.replace(then.config.train, steps=40)
    schedule = LRSchedule.of(train)
    position = RunPosition(
        step=20, config=dataclasses.replace(then.config, train=train),
        place=RankPlace(0, 1, (0, 0, 0, 0), (1, 1, 1, 1)),
        lr_schedule=LRScheduleState(schedule.kind, schedule.lr, schedule.min_lr,
                                    schedule.warmup_steps, schedule.total_steps,
                                    schedule.decay_fraction, schedule.decay_shape,
                                    schedule.decay_start, 20, schedule(20)),
        data=DataCursor(**then.groups["data"]))
    assert reader.resume_changes(decayed, position) == [
        f"train.steps is 40, the checkpoint's run used 20: the checkpoint at step 20 is past "
        f"the start of a wsd decay (the checkpoint's run decays from step 16, this run from "
        f"step 31): the learning rate of step 21 is {lr:.6g} where the checkpoint's run had "
        f"{then.groups['lr_schedule']['next_lr']:.6g}; a wsd run extends exactly from a "
        f"checkpoint of its stable phase (step <= 15)"]
