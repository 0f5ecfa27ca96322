"""Checkpoints from elsewhere: a crafted or damaged mpipar checkpoint is read completely and only
from inside its directory, or refused with exit 2 naming the file and the field or dataset,
before any tensor is used (ckpt verify, consolidate, export-hf, generate, train --resume).

Every crafted checkpoint is built from one real one (a 2-layer, hidden-32 model trained 2 steps
at tp 2, so two shard files), and sealed again as an attacker would: shard sizes and sha256 in
the index, ``index.sha256`` rewritten.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import MPIRUN, launch_env, mpirun
from untrusted import reseal
from mpipar.checkpoint import cli
from mpipar import generate
from mpipar.checkpoint import reader, tools
from mpipar.checkpoint.directory import CheckpointError

VOCAB = 256  # bytes: generate's default codec fits
MODEL = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--vocab-size", str(VOCAB)]
TRAIN = ["--seq-len", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
         "--backend", "numpy", "--log-every", "0", "--dtype", "float64"]
TENSOR = "param/embed_tokens.weight"   # split over both shards at tp 2
SHARD = "shard_00001.h5"


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def source(tmp_path_factory):
    """(the committed step-2 checkpoint of the model trained at tp 2, one rank without
    mpirun; the data file; its consolidated tensors)."""
    tmp = tmp_path_factory.mktemp("untrusted")
    data = tmp / "samples.npy"
    np.save(data, np.random.default_rng(5).integers(0, VOCAB, size=(32, 17)))
    tp = 2 if MPIRUN else 1
    launch = mpirun(tp) if tp > 1 else []
    proc = subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *MODEL, *TRAIN,
                           "--steps", "2", "--tp", str(tp), "--data", str(data),
                           "--run-dir", str(tmp / "run")],
                          capture_output=True, text=True, timeout=300, env=launch_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ck = tmp / "run" / "checkpoints" / "step_00000002"
    return ck, data, {k: reader.read_tensors(ck, k) for k in ("param", "exp_avg")}


@pytest.fixture
def ck(source, tmp_path):
    """A fresh copy of the checkpoint, ``tmp_path/save/step_00000002``, and beside the save
    directory ``tmp_path/outside/``: a copy of it that nothing may read."""
    shutil.copytree(source[0], tmp_path / "save" / "step_00000002")
    shutil.copytree(source[0], tmp_path / "outside")
    (tmp_path / "outside" / "secret").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 1024)
    return tmp_path / "save" / "step_00000002"


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (links as their target path), to show nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = os.readlink(p).encode()
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


def mappings(ds: h5py.Dataset) -> list[tuple[str, str, tuple[slice, ...]]]:
    """(file, dataset, region) of each mapping of a virtual dataset."""
    out = []
    for m in ds.virtual_sources():
        lo, hi = m.vspace.get_select_bounds()
        out.append((m.file_name, m.dset_name, tuple(slice(a, b + 1) for a, b in zip(lo, hi))))
    return out


def remap(f: h5py.File, key: str, maps: list[tuple[str, str, tuple[slice, ...]]]) -> None:
    """Replace the virtual dataset ``key`` by one of the same shape over ``maps``."""
    shape, dtype = f[key].shape, f[key].dtype
    del f[key]
    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
    for file, dataset, region in maps:
        layout[region] = h5py.VirtualSource(file, dataset, dtype=dtype,
                                            shape=tuple(s.stop - s.start for s in region))
    f.create_virtual_dataset(key, layout, fillvalue=np.nan)


def edit_index(ck: Path, change) -> None:
    with h5py.File(ck / "index.h5", "r+") as f:
        change(f)
    reseal(ck)


def source_of_shard(ck: Path, tensor: str = TENSOR, shard: str = SHARD) -> str:
    """The dataset of ``shard`` that a mapping of ``tensor`` names."""
    with h5py.File(ck / "index.h5", "r") as f:
        return next(d for file, d, _ in mappings(f[tensor]) if file == shard)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def refused(status: int, err: str, prefix: str, *words: str) -> None:
    """Exit 2, one message starting with ``prefix`` that holds every one of ``words``, no
    traceback."""
    assert status == 2, err
    assert "Traceback" not in err and err.count(prefix) == 1 and err.startswith(prefix), err
    for word in words:
        assert word in err, (word, err)


def refused_everywhere(ck: Path, capsys, monkeypatch, *words: str, verify: int = 2) -> None:
    """verify (status ``verify``), consolidate, export-hf, generate and train --resume refuse
    ``ck`` naming ``words``; nothing is written, nothing in the directory changes."""
    tmp = ck.parent.parent
    before = files(tmp)
    status, out, err = run_cli(capsys, "verify", ck)
    if verify == 2:
        refused(status, err, "mpipar.ckpt: error: ", *words)
    else:
        assert status == 1 and all(w in out for w in words) and "Traceback" not in err, out + err
    for args in (("consolidate", ck, tmp / "all.h5"), ("export-hf", ck, tmp / "hf")):
        status, _, err = run_cli(capsys, *args)
        refused(status, err, "mpipar.ckpt: error: ", *words)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    from mpipar.runtime.mpi_init import MPI
    with pytest.raises(SystemExit) as exc:
        generate.main([str(ck), "--prompt", "x", "--max-new-tokens", "2"], MPI.COMM_SELF)
    refused(exc.value.code, capsys.readouterr().err, "mpipar: error: ", *words)
    from mpipar.train import resolve_config
    with pytest.raises(SystemExit) as exc:
        resolve_config([*TRAIN, "--data", str(tmp / "none.npy"), "--run-dir", str(tmp / "run"),
                        "--resume", str(ck)], 1)
    refused(exc.value.code, capsys.readouterr().err, "mpipar: error: ", *words)
    assert files(tmp) == before


# ------------------------------------------------------------------------------ the original
def test_the_original_verifies_and_reads_whole(source, capsys):
    ck, _, tensors = source
    status, out, _ = run_cli(capsys, "verify", ck)
    assert status == 0 and "sha256 checksums match" in out
    assert all(np.isfinite(v).all() for kind in tensors.values() for v in kind.values())


# ------------------------------------------------------------------------------ problem 1
def test_a_shard_removed_after_verification_fails_the_read(ck, capsys, monkeypatch):
    """``--keep-last`` pruning a checkpoint while another process reads it: HDF5 would read the
    removed shard's regions as the fill value (NaN). mpipar reads the shards themselves, so
    consolidate, export-hf and generate exit 2 naming the shard, and write nothing."""
    real = reader.require_sound

    def verified_then_pruned(path, peers=None):
        index = real(path, peers)
        (path / SHARD).unlink(missing_ok=True)
        return index

    monkeypatch.setattr(reader, "require_sound", verified_then_pruned)
    monkeypatch.setattr(tools, "require_sound", verified_then_pruned)
    tmp = ck.parent.parent
    for args in (("consolidate", ck, tmp / "all.h5"), ("export-hf", ck, tmp / "hf")):
        shutil.copy(tmp / "outside" / SHARD, ck / SHARD)
        status, _, err = run_cli(capsys, *args)
        refused(status, err, "mpipar.ckpt: error: ", str(ck / SHARD))
        # the converters' shape and memory checks may find the shard gone before the read does
        assert "cannot be opened" in err or "missing shard" in err, err
    assert not (tmp / "all.h5").exists() and not (tmp / "hf").exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith(".")]
    shutil.copy(tmp / "outside" / SHARD, ck / SHARD)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    from mpipar.runtime.mpi_init import MPI
    with pytest.raises(SystemExit) as exc:
        generate.main([str(ck), "--prompt", "x", "--max-new-tokens", "2"], MPI.COMM_SELF)
    refused(exc.value.code, capsys.readouterr().err, "mpipar: error: ", str(ck / SHARD))


def test_a_missing_recorded_shard_is_damage_and_nothing_reads_it(ck, capsys, monkeypatch):
    (ck / SHARD).unlink()
    refused_everywhere(ck, capsys, monkeypatch, str(ck / SHARD), "missing shard", verify=1)


def test_a_mapping_to_a_file_the_index_does_not_record_is_refused(ck, capsys, monkeypatch):
    """The crafted index of problem 1: a source that does not exist verified ``ok`` and read as
    NaN (generate printed NUL bytes, resume trained on NaN)."""
    edit_index(ck, lambda f: remap(f, TENSOR, [("shard_00007.h5", d, r) if file == SHARD
                                               else (file, d, r)
                                               for file, d, r in mappings(f[TENSOR])]))
    refused_everywhere(ck, capsys, monkeypatch, "index.h5", TENSOR, "'shard_00007.h5'",
                       "not one of the shard files")


# ------------------------------------------------------------------------------ problem 2
def _outside_source(kind: str):
    """A mutation making the mapping from SHARD point at the copy in ``outside/``."""
    def change(ck: Path) -> None:
        target = (ck.parent.parent / "outside" / SHARD if kind == "absolute"
                  else Path("..") / ".." / "outside" / SHARD)
        edit_index(ck, lambda f: remap(f, TENSOR, [(str(target) if file == SHARD else file, d, r)
                                                   for file, d, r in mappings(f[TENSOR])]))
    return change


def _in_shard(change_dataset):
    """A mutation replacing SHARD's dataset that TENSOR maps by ``change_dataset(f, name, ck)``."""
    def change(ck: Path) -> None:
        name = source_of_shard(ck)
        with h5py.File(ck / SHARD, "r+") as f:
            change_dataset(f, name, ck)
        reseal(ck)
    return change


def _external_storage(f, name, ck):
    shape = f[name].shape
    del f[name]
    f.create_dataset(name, shape=shape, dtype="f8",
                     external=[(str(ck.parent.parent / "outside" / "secret"), 0,
                                8 * int(np.prod(shape)))])


def _external_link(f, name, ck):
    del f[name]
    f[name] = h5py.ExternalLink(str(ck.parent.parent / "outside" / SHARD), name)


def _virtual(f, name, ck):
    shape = f[name].shape
    del f[name]
    layout = h5py.VirtualLayout(shape=shape, dtype="f8")
    layout[...] = h5py.VirtualSource(str(ck.parent.parent / "outside" / SHARD), name, shape=shape)
    f.create_virtual_dataset(name, layout)


def _symlinked_shard(ck: Path) -> None:
    (ck / SHARD).unlink()
    (ck / SHARD).symlink_to(ck.parent.parent / "outside" / SHARD)
    reseal(ck)


def _index_link(link):
    def change(ck: Path) -> None:
        def swap(f):
            del f[TENSOR]
            f[TENSOR] = link(ck)
        edit_index(ck, swap)
    return change


def _index_external_storage(ck: Path) -> None:
    def swap(f):
        shape = f[TENSOR].shape
        del f[TENSOR]
        f.create_dataset(TENSOR, shape=shape, dtype="f8",
                         external=[(str(ck.parent.parent / "outside" / "secret"), 0,
                                    8 * int(np.prod(shape)))])
    edit_index(ck, swap)


OUTSIDE = {
    "vds-absolute-path": (_outside_source("absolute"), [TENSOR, "not one of the shard files"]),
    "vds-dotdot-path": (_outside_source("dotdot"), [TENSOR, "not one of the shard files"]),
    "shard-external-storage": (_in_shard(_external_storage), [SHARD, "stored outside the file"]),
    "shard-external-link": (_in_shard(_external_link), [SHARD, "soft or external link"]),
    "shard-virtual-dataset": (_in_shard(_virtual), [SHARD, "a virtual dataset"]),
    "shard-symlink": (_symlinked_shard, [SHARD, "a symbolic link"]),
    "index-external-link": (_index_link(lambda ck: h5py.ExternalLink(
        str(ck.parent.parent / "outside" / "index.h5"), TENSOR)), [TENSOR, "an external link"]),
    "index-soft-link": (_index_link(lambda ck: h5py.SoftLink("/exp_avg/embed_tokens.weight")),
                        [TENSOR, "a soft link"]),
    "index-external-storage": (_index_external_storage, [TENSOR, "not a virtual dataset"]),
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_nothing_outside_the_checkpoint_directory_is_read(ck, capsys, monkeypatch, case):
    """External raw storage (``outside/secret`` stands for /etc/passwd), external and soft
    links, virtual sources with absolute or ``..`` paths, a shard that is a symbolic link: every
    one verified ``ok`` or was followed (export-hf wrote /etc/passwd into model.safetensors)."""
    change, words = OUTSIDE[case]
    change(ck)
    refused_everywhere(ck, capsys, monkeypatch, *words)


# ------------------------------------------------------------------------------ problem 10
def _delete(key):
    def change(f):
        if key in f.attrs:
            del f.attrs[key]
        else:
            del f[key]
    return change


def _set_attr(key, value, group=None):
    def change(f):
        (f[group] if group else f).attrs[key] = value
    return change


def _replace(make):
    def change(f):
        del f[TENSOR]
        make(f)
    return change


MALFORMED = {
    "no-step": (_delete("step"), "attribute step is missing"),
    "no-optimizer-step": (_delete("optimizer_step"), "attribute optimizer_step is missing"),
    "no-config": (_delete("config_toml"), "attribute config_toml is missing"),
    "step-two": (_set_attr("step", "two"), "attribute step is 'two', must be an integer"),
    "step-negative": (_set_attr("step", -5), "step is -5, must be >= 0"),
    "step-array": (_set_attr("step", np.array([1, 2])), "attribute step is"),
    "config-not-toml": (_set_attr("config_toml", "[model\nhidden ="), "attribute config_toml"),
    "config-bad-field": (_set_attr("config_toml", "[model]\nhidden = 'x'\n"), "model.hidden"),
    "no-data": (_delete("data"), "data is missing"),
    "no-lr-schedule": (_delete("lr_schedule"), "lr_schedule is missing"),
    "data-field-type": (_set_attr("num_samples", "many", "data"),
                        "attribute data.num_samples is 'many'"),
    "format-version": (_set_attr("format_version", 7), "format_version is 7"),
    "group-for-tensor": (_replace(lambda f: f.create_group(TENSOR)),
                         f"{TENSOR} is a group, must be a dataset"),
    "plain-dataset": (_replace(lambda f: f.create_dataset(TENSOR, data=np.zeros((VOCAB, 32)))),
                      f"{TENSOR} is not a virtual dataset"),
    "soft-link-loop": (_replace(lambda f: f.__setitem__(TENSOR, h5py.SoftLink("/" + TENSOR))),
                       f"{TENSOR} is a soft link"),
    "dangling-external-link": (_replace(lambda f: f.__setitem__(
        TENSOR, h5py.ExternalLink("nowhere.h5", "/x"))), f"{TENSOR} is an external link"),
    "shard-record-missing": (_delete(f"shards/{SHARD}"), "'shard_00001.h5'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_metadata_names_the_file_and_field(ck, capsys, monkeypatch, case):
    """Missing or mistyped index fields and groups, a group or a plain dataset where a tensor
    belongs, a soft-link loop, a dangling external link: each was a traceback (exit 1) in
    verify, consolidate, generate or resume."""
    change, words = MALFORMED[case]
    edit_index(ck, change)
    refused_everywhere(ck, capsys, monkeypatch, str(ck / "index.h5"), words)


# ------------------------------------------------------------------------------ problem 14
def _train(tmp: Path, data: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpipar.train", *TRAIN, "--steps", "3",
                           "--data", str(data), "--run-dir", str(tmp), *flags],
                          capture_output=True, text=True, timeout=300, env=launch_env())


def _stopped_before_step_1(proc: subprocess.CompletedProcess, run: Path, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "Traceback" not in err and err.count("mpipar: error: ") == 1, err
    for word in words:
        assert word in err, (word, err)
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    assert not [p for p in (run / "checkpoints").glob("step_*")]


def test_non_finite_weights_stop_a_run_before_step_1(source, ck, tmp_path):
    """A NaN in an mpipar checkpoint (resume) and an infinity in a Hugging Face directory
    (--init-from-hf): both trained step 1 (one then exited 3 and committed a NaN checkpoint).
    Both exit 2 naming the tensor, before any step, writing no metrics and no checkpoint."""
    _, data, _ = source
    name = source_of_shard(ck)
    with h5py.File(ck / SHARD, "r+") as f:
        f[name][1, 2] = np.nan
    reseal(ck)
    assert reader.verify(ck) == []  # sound as a file: the values are what is wrong
    _stopped_before_step_1(_train(tmp_path / "a", data, "--resume", str(ck)), tmp_path / "a",
                           str(ck), TENSOR, "1 NaN")

    from mpipar.checkpoint.huggingface import load_hf, save_hf
    tools.export_hf(source[0], tmp_path / "hf")
    model, params = load_hf(tmp_path / "hf")
    params["layers.1.mlp.down_proj.weight"][0, 3] = np.inf
    save_hf(tmp_path / "hf-inf", model, params, dtype="float64")
    _stopped_before_step_1(_train(tmp_path / "b", data, "--init-from-hf", str(tmp_path / "hf-inf")),
                           tmp_path / "b", "layers.1.mlp.down_proj.weight")


# ------------------------------------------------------------------------------ fuzz
def _values(rng: random.Random):
    return rng.choice(["two", "", -5, 0, 2**62, 1.5, float("nan"), float("inf"), True,
                       np.array([1, 2]), b"\xff\xfe", np.float32(3), "mpipar-checkpoint",
                       h5py.Empty("f8"), np.array([[1.5]])])


def _fuzz_mutation(rng: random.Random, f: h5py.File, ck: Path) -> str:
    """One random change of the index ``f``; returns what it did."""
    groups = ["layout", "lr_schedule", "data", "rng", f"shards/{SHARD}"]
    names = list(f["param"])
    kind = rng.choice(["param", "exp_avg", "exp_avg_sq"])
    key = f"{kind}/{rng.choice(names)}"
    what = rng.randrange(8)
    if what == 0:
        group = rng.choice([None, *groups])
        obj = f[group] if group else f
        attr = rng.choice(list(obj.attrs))
        if rng.random() < 0.3:
            del obj.attrs[attr]
            return f"del {group}.{attr}"
        value = _values(rng)
        obj.attrs[attr] = value
        return f"{group}.{attr} = {value!r}"
    if what == 1:
        victim = rng.choice([*groups, key, kind, "shards"])
        del f[victim]
        return f"del {victim}"
    if what == 2:
        other = f"{rng.choice(['param', 'exp_avg'])}/{rng.choice(names)}"
        link = rng.choice([h5py.SoftLink("/" + other), h5py.SoftLink("/" + key),
                           h5py.ExternalLink(str(ck.parent.parent / "outside" / "index.h5"), key),
                           h5py.ExternalLink("missing.h5", "/x")])
        del f[key]
        f[key] = link
        return f"{key} -> {link}"
    if what == 3:
        del f[key]
        if rng.random() < 0.5:
            f.create_group(key)
        else:
            f.create_dataset(key, data=np.zeros(3))
        return f"{key} replaced by a group or a plain dataset"
    if what == 4:
        other = f"{kind}/{rng.choice(names)}"
        if other != key:
            del f[key]
            f[key] = f[other]  # a hard link: the same object under two names
        return f"{key} hard link to {other}"
    maps = mappings(f[key])
    i = rng.randrange(len(maps))
    file, dataset, region = maps[i]
    if what == 5:
        file = rng.choice([str(ck.parent.parent / "outside" / file), f"../{file}", ".",
                           "shard_00007.h5", "shard_00000.h5", SHARD])
    elif what == 6:
        dataset = rng.choice([dataset.rsplit("/", 1)[0] + "/9", f"param/{rng.choice(names)}/0",
                              "/" + dataset, dataset])
    else:
        region = tuple(slice(s.start + 1, s.stop + 1) if s.stop < n else s
                       for s, n in zip(region, f[key].shape))
    maps[i] = (file, dataset, region)
    remap(f, key, maps)
    return f"{key} mapping {i} -> {maps[i][:2]} {maps[i][2]}"


def mutate(rng: random.Random, ck: Path) -> list[str]:
    """One or two random changes of ``ck``'s index, sealed again; what was done."""
    done = []
    with h5py.File(ck / "index.h5", "r+") as f:
        for _ in range(rng.choice([1, 1, 2])):
            try:
                done.append(_fuzz_mutation(rng, f, ck))
            except (KeyError, ValueError, TypeError, OSError, RuntimeError) as exc:
                done.append(f"(h5py refused a change: {exc})")  # e.g. a name already deleted
    reseal(ck)
    return done


def test_fuzzed_indexes_never_trace_back_or_read_nan(source, tmp_path, capsys):
    """Random changes of fields, types, links and mappings of the index, sealed again: verify,
    inspect and consolidate exit 0, 1 or 2, never with a traceback, and what consolidate writes
    is finite (HDF5's fill value is never read). Bounded to a few seconds."""
    shutil.copytree(source[0], tmp_path / "outside")
    rng = random.Random(33)
    deadline, cases = time.monotonic() + 4, 0
    while time.monotonic() < deadline and cases < 300:
        ck = tmp_path / f"case{cases}" / "save" / "step_00000002"
        shutil.copytree(source[0], ck)
        (ck.parent.parent / "outside").symlink_to(tmp_path / "outside")
        done = mutate(rng, ck)
        out = ck.parent.parent / "all.h5"
        for args in (("verify", ck), ("inspect", ck), ("consolidate", ck, out)):
            try:
                status, _, err = run_cli(capsys, *args)
            except Exception as exc:  # the failure this test exists to catch
                raise AssertionError(f"{done}: {args[0]} raised {exc!r}") from exc
            assert status in (0, 1, 2) and "Traceback" not in err, (done, args[0], err)
        if out.exists():
            with h5py.File(out, "r") as f:
                for kind in ("param", "exp_avg", "exp_avg_sq"):
                    for name, ds in f[kind].items():
                        assert np.isfinite(ds[()]).all(), (done, kind, name)
        shutil.rmtree(tmp_path / f"case{cases}")
        cases += 1
    assert cases >= 5


def test_open_reader_refuses_a_region_outside_the_tensor(source):
    with reader.open_reader(source[0]) as read:
        assert read("param", "norm.weight", (slice(0, 32),)).shape == (32,)
        with pytest.raises(CheckpointError, match="norm.weight has shape"):
            read("param", "norm.weight", (slice(0, 33),))
        with pytest.raises(CheckpointError, match="has no param/nothing"):
            read("param", "nothing", (slice(0, 1),))
