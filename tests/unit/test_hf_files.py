"""Hugging Face directories as files (no torch needed), in process: an export honours the umask.
Damaged or inconsistent directories refused by training and ``hf inspect``: e2e/test_hf_files.py."""
from __future__ import annotations

import os
import stat

import pytest

from hf_export import export_small_model
from mpipar.checkpoint.huggingface import CONFIG_FILE, WEIGHTS_FILE


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_an_export_honours_the_umask(tmp_path, mask):
    """Exports were 0700 (directory) and 0600 (files) whatever the umask."""
    old = os.umask(mask)
    try:
        export_small_model(tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o777 & ~mask
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert stat.S_IMODE(os.stat(tmp_path / "out" / name).st_mode) == 0o666 & ~mask
