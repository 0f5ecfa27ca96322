"""jobs/gpu_check.sh, the device check, without a device: it parses, every stage it runs by
default is documented in jobs/README.md and handled by the script, and a stage that needs no
device (``env``) runs here and records nothing it cannot."""
from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "jobs", "gpu_check.sh")


def _default_stages() -> list[str]:
    text = open(SCRIPT).read()
    return re.search(r'STAGES=\$\{\*:-"([^"]+)"\}', text).group(1).split()


def test_the_script_parses_and_documents_each_stage():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "jobs", "gpu_wheels.sh")]).returncode == 0
    text, readme = open(SCRIPT).read(), open(os.path.join(ROOT, "jobs", "README.md")).read()
    stages = _default_stages()
    assert stages[:3] == ["env", "setup", "gate"] and "bench" in stages and "profile" in stages
    documented = set(re.findall(r"^\| `([a-z0-9]+)`", readme, re.M))
    for stage in stages:
        handled = f"has {stage}" in text or (stage.startswith("engine") and "engine$n" in text)
        assert handled, f"stage {stage} is listed but not handled"
        assert stage in documented or stage.startswith("engine"), f"{stage} not in jobs/README"
    assert "`engine1` .. `engine8`" in readme


def test_the_env_stage_runs_without_a_device(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", SCRIPT, str(out), "env"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "=== gpu_check: env" in proc.stdout and "--- summary" in proc.stdout
    assert "numpy" in (out / "device.txt").read_text()
    assert (out / "all.tgz").stat().st_size > 0


def test_stages_not_begun_by_the_deadline_are_skipped_and_recorded(tmp_path):
    """GPU_CHECK_DEADLINE: a named stage that would begin at or after it is skipped, said and
    recorded ("env skipped"), and the summary and all.tgz are still written."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", SCRIPT, str(out), "env"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "GPU_CHECK_DEADLINE": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "=== gpu_check: env skipped" in proc.stdout and "--- summary" in proc.stdout
    assert (out / "results.txt").read_text().split("\n")[0] == "env skipped"
    assert not (out / "device.txt").exists() and (out / "all.tgz").stat().st_size > 0


def test_the_kernel_micro_benchmark_uses_the_1b_models_shapes():
    from mpipar.bench import gpu, gpu_kernels as k
    m = gpu.MODELS["1.1B"]
    assert (k.T, k.H, k.F, k.V) == (gpu.TOKENS_PER_STEP, m["hidden"], m["ffn_hidden"],
                                     m["vocab_size"])
    assert (k.HQ, k.HKV, k.D) == (m["heads"], m["kv_heads"], m["hidden"] // m["heads"])


IMAGE = {"numpy", "numba", "scipy", "h5py", "mpi4py", "ml-dtypes", "safetensors"}
"""What the device image holds of mpipar's requirements (../shared/GPU.md; scipy and safetensors
come with its PyTorch and transformers): the rest must come as wheels."""


def test_every_requirement_is_on_the_image_or_among_the_wheels():
    """The device cannot download: each of setup.cfg's install_requires for Python >= 3.11 is
    either on the image or fetched by jobs/gpu_wheels.sh."""
    cfg = open(os.path.join(ROOT, "setup.cfg")).read()
    block = re.search(r"install_requires =\n((?:    .+\n)+)", cfg).group(1)
    names = {re.match(r"[A-Za-z0-9_.-]+", line.strip()).group(0).lower()
             for line in block.splitlines() if "python_version <" not in line}
    wheels = open(os.path.join(ROOT, "jobs", "gpu_wheels.sh")).read()
    fetched = set(re.search(r"--platform any \\\n((?:.+\\\n)*.+)\n", wheels).group(1).split()) - {"\\"}
    assert "tqdm" in fetched and "threadpoolctl" in names
    missing = sorted(n for n in names if n not in IMAGE and n not in fetched)
    assert not missing, f"requirements neither on the device image nor in gpu_wheels.sh: {missing}"
