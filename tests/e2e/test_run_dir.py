"""Run directories that cannot be lost: every output target created and proved writable before
step 1, a lock against a second run, no fresh run over an earlier run's checkpoints, and a
metrics log that holds each step once across crashes and resumes.

Every test launches ``python -m mpipar.train`` as a subprocess and then checks that nothing was
lost: the checkpoints verify, ``latest`` names a good one, and ``metrics.jsonl`` holds each step
once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import MPIRUN, needs_mpirun
from launch import TINY, metrics, run_train, start_train, wait_for_steps
from mpipar.checkpoint import directory, reader
from mpipar.observe.metrics import read_records
from mpipar.model.params import param_specs

UNSHARE = shutil.which("unshare")


def _intact(run_dir, steps: list[int], save_dir=None) -> None:
    """Nothing lost: metrics hold ``steps`` once each, ``latest`` names the last, it verifies."""
    save = save_dir or os.path.join(run_dir, "checkpoints")
    assert [r["step"] for r in metrics(run_dir)] == steps
    assert directory.latest(save) == directory.resolve_path(save)
    assert directory.resolve_path(save).name == directory.step_dir_name(steps[-1])
    assert all(reader.verify(p) == [] for p in directory.list_checkpoints(save))


def _readonly(directory) -> list[str]:
    """A command prefix that runs a command with a read-only tmpfs mounted on ``directory``, in
    a user and mount namespace of its own (no privileges needed, nothing left mounted)."""
    probe = subprocess.run([UNSHARE, "-rm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {directory}"],
                           capture_output=True, text=True) if UNSHARE else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a read-only filesystem here ({probe and probe.stderr.strip()})")
    return [UNSHARE, "-rm", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"',
            str(directory)]


# ------------------------------------------------------------------ 1, 2: output targets
@needs_mpirun
@pytest.mark.parametrize("flag,target,message", [
    ("--save-dir", "ro/ck", "--save-dir {ro}/ck: cannot create the directory (Read-only file "
                            "system"),
    ("--export-hf", "ro/hf", "--export-hf {ro}: not writable (Read-only file system)"),
    ("--run-dir", "ro", "--run-dir {ro}: not writable (Read-only file system)"),
])
def test_an_unwritable_output_is_found_before_step_1(tmp_path, flag, target, message):
    """``--save-dir`` on a read-only filesystem was noticed at the first save,
    after the whole run had trained. Now every output target is checked before step 1: exit 2
    on every rank, the flag and the reason printed once, nothing trained."""
    (tmp_path / "ro").mkdir()
    run_dir = tmp_path / "run" if flag != "--run-dir" else tmp_path / "ro"
    args = [*TINY, "--steps", "3", "--run-dir", str(run_dir), flag, str(tmp_path / target)]
    proc = subprocess.run([*_readonly(tmp_path / "ro"), MPIRUN, "-n", "2", sys.executable, "-m",
                           "mpipar.train", *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(message.format(ro=tmp_path / "ro")) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "step" not in proc.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag,blocker", [("--run-dir", "run"),
                                          ("--dump-activations", "run/activations"),
                                          ("--recompute", "run/scratch")])
def test_a_file_where_an_output_directory_goes_is_named(tmp_path, flag, blocker):
    """A file-typed ``--run-dir`` was a traceback; the same for the dump and
    offload directories inside it."""
    if blocker != "run":
        (tmp_path / "run").mkdir()
    (tmp_path / blocker).write_text("a file, not a directory")
    extra = {"--run-dir": [], "--dump-activations": ["--dump-activations", "1"],
             "--recompute": ["--recompute", "offload"]}[flag]
    proc = run_train(1, [*TINY, "--steps", "1", "--run-dir", str(tmp_path / "run"), *extra],
                     timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{flag}" in proc.stderr, proc.stderr
    assert f"{tmp_path / blocker}: exists and is not a directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / blocker).read_text() == "a file, not a directory"


def test_the_parents_of_every_output_are_created(tmp_path):
    """``--run-dir X --export-hf X/hf`` was refused because X did not exist
    yet. Every output path's parents are created; the export lands where it was asked."""
    from mpipar.checkpoint.huggingface import load_hf

    run = tmp_path / "new" / "exp"
    proc = run_train(1, [*TINY, "--steps", "2", "--run-dir", str(run), "--export-hf",
                     str(run / "hf"), "--save-dir", str(tmp_path / "elsewhere" / "ck"),
                     "--dump-activations", "2"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    cfg, params = load_hf(run / "hf")
    assert cfg.hidden == 32 and sorted(params) == sorted(s.name for s in param_specs(cfg))
    assert sorted(os.listdir(run / "activations" / "step_2")) == ["rank_0.h5"]
    _intact(run, [1, 2], tmp_path / "elsewhere" / "ck")


# ----------------------------------------------------------------------------- 3: the lock
@needs_mpirun
def test_a_second_run_in_a_busy_directory_exits_2_naming_the_holder(tmp_path):
    """A second run in the same run directory overwrote the first one's
    checkpoints and truncated its metrics. Now the running job holds a lock: a second run (same
    run directory, or only the same save directory) exits 2 naming it, and the first run goes
    on and ends intact."""
    run = tmp_path / "run"
    first = start_train(2, [*TINY, "--steps", "100000", "--save-every", "2", "--run-dir",
                        str(run)])
    try:
        wait_for_steps(run, 3, first)
        holder = (run / "lock").read_text()
        assert holder.startswith("pid ") and "mpipar.train" in holder, holder
        for args in (["--run-dir", str(run)],
                     ["--run-dir", str(tmp_path / "other"), "--save-dir", str(run / "checkpoints"),
                      "--resume", "auto"]):
            second = run_train(2, [*TINY, "--steps", "5", *args], timeout=120)
            assert second.returncode == 2, second.stderr
            busy = run if args[1] == str(run) else run / "checkpoints"
            holder = (busy / "lock").read_text().strip()
            assert second.stderr.count(f"{busy} is in use by another run ({holder})") == 1
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    last = metrics(run)[-1]["step"]
    _intact(run, list(range(1, last + 1)))


@needs_mpirun
def test_two_runs_started_at_once_never_mix(tmp_path):
    """Two runs started at once in one directory deleted each other's
    in-progress saves. Exactly one of them runs; the other exits 2 (the directory is locked,
    or, if the first one has already finished, it holds the first one's checkpoints)."""
    run = tmp_path / "run"
    procs = [start_train(2, [*TINY, "--steps", "4", "--save-every", "1", "--run-dir", str(run)])
             for _ in range(2)]
    results = [(p.wait(timeout=240), p.communicate()[1]) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    err = next(e for code, e in results if code == 2)
    assert "is in use by another run" in err or "holds checkpoints of an earlier run" in err, err
    _intact(run, [1, 2, 3, 4])


def test_a_fresh_run_beside_earlier_checkpoints_is_refused(tmp_path):
    """A fresh run (no --resume) in a directory with checkpoints now exits 2
    saying how to continue, and leaves them as they were; --resume auto continues them."""
    run = tmp_path / "run"
    assert run_train(1, [*TINY, "--steps", "2", "--run-dir", str(run)]).returncode == 0
    before = metrics(run)
    fresh = run_train(1, [*TINY, "--steps", "3", "--run-dir", str(run)])
    assert fresh.returncode == 2
    assert (f"--save-dir {run / 'checkpoints'} holds checkpoints of an earlier run (newest "
            f"step_00000002); a fresh run would overwrite them: use --resume auto to continue "
            f"it, or a new --run-dir") in fresh.stderr, fresh.stderr
    assert metrics(run) == before
    _intact(run, [1, 2])
    again = run_train(1, [*TINY, "--steps", "3", "--run-dir", str(run), "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    _intact(run, [1, 2, 3])


# -------------------------------------------------------------- 4: metrics across crashes
def test_resume_after_a_crash_keeps_each_step_once_despite_a_torn_line(tmp_path):
    """After a crash the log holds steps past the last checkpoint, maybe with
    a torn last line; resume failed on the torn line (JSONDecodeError), and the steps it trained
    again appeared twice. Now resume cuts the log back to its step (tolerating the torn tail)
    and the log is fsynced before each checkpoint commits."""
    run = tmp_path / "run"
    proc = start_train(1, [*TINY, "--steps", "100000", "--save-every", "3", "--run-dir",
                       str(run)])
    wait_for_steps(run, 5, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate(timeout=60)
    crashed = metrics(run)
    saved = int(directory.latest(run / "checkpoints").name.split("_")[1])
    assert saved % 3 == 0 and len(crashed) >= saved, (saved, len(crashed))
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": ' + str(len(crashed) + 1) + ', "loss": 5.4')  # a torn write
    again = run_train(1, [*TINY, "--steps", str(saved + 2), "--run-dir", str(run), "--resume",
                      "auto"])
    assert again.returncode == 0, again.stderr
    _intact(run, list(range(1, saved + 3)))
    assert metrics(run)[:saved] == crashed[:saved]  # the records before the checkpoint kept
    assert json.loads((run / "summary.json").read_text())["steps"] == [1, saved + 2]


KILL_DURING_SAVE = """
import os, signal, sys
from mpipar import train
from mpipar.checkpoint import writer
real = writer._write_shard
def write_shard(path, pieces, state, place, *rest):
    if path.parent.name == ".step_00000004.tmp" and place.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # rank 1 dies saving step 4; rank 0 wrote its shard
    return real(path, pieces, state, place, *rest)
writer._write_shard = write_shard
sys.exit(train.main(sys.argv[1:]))
"""


@needs_mpirun
def test_a_fallback_to_an_older_checkpoint_cuts_the_log_back_to_it(tmp_path):
    """A rank dies while saving step 4 (half the shards written). The record
    of step 4 is already in the log (a record is written before its checkpoint commits); resume
    falls back to step 2 and the log holds steps 1..6 once each, the first two unchanged."""
    run = tmp_path / "run"
    args = [*TINY, "--steps", "6", "--save-every", "2", "--dp", "2", "--zero", "1",
            "--run-dir", str(run)]
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE)
    proc = run_train(2, args, script=str(script))
    assert proc.returncode != 0, proc.stderr
    assert directory.latest(run / "checkpoints") == run / "checkpoints" / "step_00000002"
    crashed = read_records(str(run / "metrics.jsonl"))
    assert [r["step"] for r in crashed] == [1, 2, 3, 4]
    again = run_train(2, [*args, "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in again.stdout
    _intact(run, [1, 2, 3, 4, 5, 6])
    assert metrics(run)[:2] == crashed[:2]
