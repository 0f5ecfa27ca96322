"""The cuDNN attention backend's import is lazy: in a fresh interpreter it imports neither the
cuDNN frontend nor CuPy."""
from __future__ import annotations


def test_import_is_lazy():
    """Importing the module imported neither cudnn nor cupy (CI has neither)."""
    import subprocess
    import sys
    code = ("import sys, mpipar.kernels.cudnn_attention; "
            "print('cudnn' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
