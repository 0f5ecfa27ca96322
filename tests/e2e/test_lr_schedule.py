"""The warmup-stable-decay (wsd) learning-rate schedule in launched runs: resuming a stable-phase
checkpoint with more steps extends the run."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import launch_env
from mpipar.checkpoint import reader
from mpipar.checkpoint.index import read_index
from mpipar.checkpoint.records import DataCursor, LRScheduleState, RankPlace, RunPosition
from mpipar.training.optim import LRSchedule, extends_with_steps


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
    assert reader.resume_changes(decayed, position, extends_with_steps) == [
        f"train.steps is 40, the checkpoint's run used 20: the checkpoint at step 20 is past "
        f"the start of a wsd decay (the checkpoint's run decays from step 16, this run from "
        f"step 31): the learning rate of step 21 is {lr:.6g} where the checkpoint's run had "
        f"{then.groups['lr_schedule']['next_lr']:.6g}; a wsd run extends exactly from a "
        f"checkpoint of its stable phase (step <= 15)"]
