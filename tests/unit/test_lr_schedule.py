"""The warmup-stable-decay (wsd) learning-rate schedule in process: every step against the formula
for each decay shape, a longer run's schedule, the other schedules unchanged, and its
configuration rules. Extending a launched run from a stable-phase checkpoint:
e2e/test_lr_schedule.py."""
from __future__ import annotations

import math

import pytest

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
