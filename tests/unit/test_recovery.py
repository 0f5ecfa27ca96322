"""--on-rank-failure without MPI traffic: the mode objects, the layout of the survivors
(mpipar.train.relayout) and the flags that reproduce it; a LoRA run's copy in memory restoring a
rebuilt rank exactly. The recovery itself runs under Open MPI
with ULFM: tests/e2e/test_rank_failure.py."""
from __future__ import annotations

import argparse

import pytest

from mpipar.config import cli as config_cli
from mpipar.config import ConfigError
from mpipar.rules import validate
from mpipar.train import relayout
from mpipar.runtime import ulfm
from mpipar.training.recovery import Abort, Shrink, layout_flags, layout_text, on_rank_failure

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
        "--micro-batch-size", "1"]


def _layout(world: int, *flags: str):
    parser = argparse.ArgumentParser()
    config_cli.add_arguments(parser)
    return validate(config_cli.from_args(parser.parse_args([*TINY, *flags])), world)


def test_dp_shrinks_and_the_global_batch_is_kept():
    """dp=4 -> 3 survivors: dp=3, the same 12 rows a step, 4 microbatches a replica instead of
    3; the flags name that layout."""
    old = _layout(4, "--global-batch-size", "12")
    new = relayout(old, 3)
    assert (new.dp, new.tp, new.pp, new.sp) == (3, 1, 1, 1)
    assert new.train.global_batch_size == 12
    assert (old.microbatches, new.microbatches) == (3, 4)
    assert layout_flags(new) == "--dp 3 --tp 1 --pp 1 --sp 1 --ep 1 --zero 0 --micro-batch-size 1"
    assert layout_text(new) == "dp=3 tp=1 pp=1 sp=1 ep=1 zero=0"
    assert relayout(old, 2).microbatches == 6


def test_tp_and_pp_are_kept_when_the_survivors_allow_it():
    old = _layout(8, "--global-batch-size", "12", "--pp", "2", "--dp", "4")
    new = relayout(old, 6)
    assert (new.dp, new.pp) == (3, 2) and new.train.global_batch_size == 12


def test_else_the_planner_chooses_and_none_fitting_is_an_error():
    """pp=2 on 3 survivors cannot stay: the planner's layout of 3 ranks (dp=3); a batch of 8
    rows fits no layout of 3 ranks of this model: ConfigError naming the rule."""
    new = relayout(_layout(4, "--global-batch-size", "12", "--pp", "2", "--dp", "2"), 3)
    assert new.world == 3 and new.train.global_batch_size == 12
    with pytest.raises(ConfigError, match="global_batch_size"):
        relayout(_layout(4, "--global-batch-size", "8"), 3)


def test_the_modes_are_objects():
    abort = on_rank_failure("abort", relayout, "ckpt")
    assert isinstance(abort, Abort) and abort.survivable == () and abort.refusal() is None
    assert isinstance(on_rank_failure("shrink", relayout, "ckpt"), Shrink)
    with pytest.raises(ValueError, match="on_rank_failure='retry'"):
        on_rank_failure("retry", relayout, "ckpt")


def test_a_lora_runs_copy_in_memory_is_its_adapters_and_moments_and_restores_it_exactly():
    """Under LoRA the copy a shrink restores from holds the adapters, their AdamW moments and
    the step, and no frozen base (the rebuilt rank makes its seed base again): a fresh rank
    loaded from the copy taken before step 3 trains step 3 exactly as the original did."""
    import numpy as np
    from mpi4py import MPI

    from layouts import small_config, token_source
    from mpipar.model.lora import is_adapter
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from mpipar.training.recovery import StateCopy

    cfg = small_config("float64")
    cfg.train.__dict__.update(lora_rank=4, lora_alpha=8.0)     # the default: all seven targets
    layout = validate(cfg, 1)
    eng = build_rank(layout, MPI.COMM_SELF, source=token_source())
    for k in range(2):
        trainer.train_step(eng, k)
    assert StateCopy.holds_everything(eng)
    copy = StateCopy(eng)
    names = {n for _, n in copy.tensors}
    assert names and all(is_adapter(n) for n in names)
    assert {kind for kind, _ in copy.tensors} == {"param", "exp_avg", "exp_avg_sq"}
    want = trainer.train_step(eng, 2)
    trained = trainer.gather_params(eng)
    trainer.close(eng)
    fresh = build_rank(layout, MPI.COMM_SELF, source=token_source())
    copy.load(fresh)
    got = trainer.train_step(fresh, 2)
    again = trainer.gather_params(fresh)
    trainer.close(fresh)
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    assert all(np.array_equal(again[n], trained[n]) for n in trained)


def test_a_silent_rank_is_declared_failed_within_the_collective_timeout(tmp_path):
    """Under shrink with --collective-timeout 20 (flag or TOML), Open MPI's heartbeat detector
    is set before MPI_Init: its own thread, declaring a rank failed after 10 s silent, a beat
    every 2.5 s; nothing without a timeout or under abort, and a value set already stays."""
    env: dict[str, str] = {}
    ulfm.preset(["--on-rank-failure", "shrink", "--collective-timeout", "20"], env)
    assert env == {"OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_thread": "true",
                   "OMPI_MCA_mpi_ft_detector_timeout": "10",
                   "OMPI_MCA_mpi_ft_detector_period": "2.5"}
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\non_rank_failure = "shrink"\ncollective_timeout = 20.0\n')
    env = {"OMPI_MCA_mpi_ft_detector_timeout": "3"}
    ulfm.preset(["--config", str(toml)], env)
    assert env["OMPI_MCA_mpi_ft_detector_timeout"] == "3" and len(env) == 4
    for argv in (["--on-rank-failure", "shrink"], ["--collective-timeout", "20"],
                 ["--on-rank-failure", "shrink", "--collective-timeout", "soon"]):
        env = {}
        ulfm.preset(argv, env)
        assert env == {}, argv


def test_a_rank_declared_failed_is_killed_by_the_first_survivor_on_its_node():
    """fence: the first survivor on a failed rank's node kills its process (a child process
    stands for it here); a survivor that is not the first on the node, and a failed rank on
    another node, are left alone."""
    import os
    import signal
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = os.uname().nodename
        peers = [(here, os.getpid()), (here, child.pid), ("other", 1), (here, os.getpid())]
        assert ulfm.fence([1, 2], peers, me=3) == []
        assert ulfm.fence([1, 2], peers, me=0) == [1]
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()


@pytest.mark.parametrize("flags,message", [
    (["--on-rank-failure", "shrink", "--state-copies", "2"],
     "train.state_copies=2: must be 0 or 1"),
    (["--state-copies", "1"], "train.state_copies=1 with train.on_rank_failure='abort': the "
                              "copies serve a shrink only"),
    (["--on-rank-failure", "shrink", "--state-copies", "1", "--optimizer", "muon"],
     "train.state_copies=1 with train.optimizer='muon'"),
], ids=["two copies", "without shrink", "muon"])
def test_state_copies_are_refused_where_they_cannot_serve(flags, message, capsys):
    """``--state-copies``: 0 or 1, with ``--on-rank-failure shrink`` and AdamW; else exit 2
    naming the value and the rule, before any collective."""
    from mpipar.train import resolve_config
    with pytest.raises(SystemExit) as exc:
        resolve_config([*TINY, "--global-batch-size", "4", "--dp", "4", *flags], 4)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_ranks_copy_is_held_on_another_node_where_there_are_several():
    """The holder of each rank's share: on another node when the nodes allow it (two nodes of
    two ranks: across them; three ranks on two nodes: one shift fits none, the next rank), else
    the next rank."""
    from mpipar.training.state_copies import holders
    assert holders(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert holders(["a", "b", "a", "b"]) == [1, 2, 3, 0]
    assert holders(["a", "a", "a"]) == [1, 2, 0]
    assert holders(["a", "a", "b"]) == [1, 2, 0]
