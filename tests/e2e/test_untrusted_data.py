"""``python -m mpipar.data prepare`` launched into a full or a read-only filesystem (a tmpfs in a
namespace of its own): exit 2 with one message naming ``--out``, nothing left behind."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import launch_env
from small_tokenizers import tokenizer_dir  # noqa: F401  (a fixture)

UNSHARE = shutil.which("unshare")


def _in_a_small_filesystem(directory, command: list[str], options: str = "size=1m"
                           ) -> subprocess.CompletedProcess:
    """Run ``command`` with a tmpfs mounted on ``directory`` with ``options`` (1 MiB; "ro":
    read-only), in a user and mount namespace of its own (no privileges needed, nothing left
    mounted), then list the directory; skip where that is not possible."""
    mount = f"mount -t tmpfs -o {options} tmpfs"
    probe = subprocess.run([UNSHARE, "-rm", "sh", "-c", f"{mount} {directory}"],
                           capture_output=True, text=True) if UNSHARE else None
    if probe is None or probe.returncode:
        pytest.skip(f"cannot mount a filesystem here ({probe and probe.stderr.strip()})")
    script = f'{mount} "$0" && "$@"; echo "status $?"; ls -A "$0"'
    return subprocess.run([UNSHARE, "-rm", "sh", "-c", script, str(directory), *command],
                          capture_output=True, text=True, timeout=240, env=launch_env())


@pytest.mark.parametrize("tokenized", [False, True], ids=["bytes", "tokenizer"])
def test_a_full_disk_is_an_error_not_a_crash(tmp_path, tokenizer_dir, tokenized):
    """A full disk during ``data prepare`` is one message and status 2, not a crash: the HDF5
    file is closed before it is removed (unlinked while open it could not be closed, and the
    process ended in a segmentation fault), and the directory is left empty."""
    text = tmp_path / "big.txt"
    text.write_text("the cat sat on the mat\n" * 200_000)  # 4.6 MB into 1 MiB
    full = tmp_path / "full"
    full.mkdir()
    extra = ["--tokenizer", str(tokenizer_dir)] if tokenized else []
    proc = _in_a_small_filesystem(full, [sys.executable, "-m", "mpipar.data", "prepare",
                                         str(text), "--out", str(full / "x.h5"), *extra])
    assert proc.stdout.splitlines() == ["status 2"], proc.stdout + proc.stderr  # nothing left
    assert proc.stderr.splitlines() == [f"error: --out {full / 'x.h5'}: cannot be written (No "
                                        f"space left on device)"], proc.stderr


def test_a_read_only_output_directory_is_named_before_tokenizing(tmp_path, tokenizer_dir):
    """An unwritable output directory is found before tokenising: the temporary output file is
    created first, and the run exits 2 naming --out and the reason."""
    (tmp_path / "in.txt").write_text("the cat sat")
    locked = tmp_path / "locked"
    locked.mkdir()
    proc = _in_a_small_filesystem(locked, [sys.executable, "-m", "mpipar.data", "prepare",
                                           str(tmp_path / "in.txt"), "--out",
                                           str(locked / "x.h5"), "--tokenizer",
                                           str(tokenizer_dir)], options="ro")
    assert proc.stdout.splitlines() == ["status 2"], proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [f"error: --out {locked / 'x.h5'}: cannot be written in "
                                        f"{locked} (Read-only file system)"], proc.stderr
