"""Sizes a flag or a file declares, bounded before anything is allocated: each case runs the
real command (in a child capped in address space where the input could make it allocate, or in
this process), and asserts exit status 2, one message naming the value and the rule, no
traceback, within seconds."""
from __future__ import annotations

import pytest

from mpipar.config import trace_step_set
from untrusted import TINY, run_bounded, run_train

T = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
     "--global-batch-size", "4", "--backend", "numpy", "--tensorboard", "off"]


def _one_error(code, err, message) -> None:
    assert code == 2, err
    assert err.count("mpipar: error:") == 1 and message in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------ --trace-steps
def test_a_range_of_trace_steps_is_held_as_a_range(tmp_path):
    code, err, seconds = run_bounded(["-c", """if True:
        from mpipar.config import trace_step_set
        steps = trace_step_set("3,10-99999999999999999999")
        assert steps.last == 99999999999999999999
        assert 3 in steps and 10**19 in steps and 4 not in steps and 10**20 not in steps"""],
        tmp_path, memory=1 << 30, timeout=60)
    assert code == 0 and seconds < 30, err


def test_trace_steps_name_the_steps_they_hold():
    assert [s for s in range(12) if s in trace_step_set("2,5-6,9")] == [2, 5, 6, 9]
    assert trace_step_set("4").last == 4 and not trace_step_set("0")


def test_a_huge_trace_range_is_refused_within_bounded_memory(tmp_path):
    code, err, seconds = run_bounded(
        ["-m", "mpipar.train", *T, "--steps", "1", "--trace-steps", "1-99999999999999999999",
         "--run-dir", str(tmp_path / "run")], tmp_path, memory=3 << 30, timeout=120)
    _one_error(code, err, "train.trace_steps='1-99999999999999999999': step "
                          "99999999999999999999 is past train.steps=1")
    assert seconds < 60 and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("spec", ["2-5", "5", "1,4", "3-3,2-4"])
def test_trace_steps_past_the_last_step_are_refused(tmp_path, spec):
    code, err = run_train([*TINY, "--trace-steps", spec, "--run-dir", str(tmp_path)])
    _one_error(code, err, f"train.trace_steps={spec!r}: step")
    assert "is past train.steps=3" in err and not (tmp_path / "trace.json").exists()


# --------------------------------------------------------------- Hugging Face expert counts
@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face export of a small dense model (float32)."""
    import numpy as np

    from mpipar.checkpoint.huggingface import save_hf
    from mpipar.config import ModelConfig
    from mpipar.layout import resolve_model
    from mpipar.model.params import init_params
    model = resolve_model(ModelConfig(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2,
                                      ffn_hidden=64))
    save_hf(tmp_path / "hf", model, init_params(model, 3, np.float32))
    return tmp_path / "hf"


MOE_BOMBS = [
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
          num_local_experts=10**12), "num_local_experts=1000000000000 must be at most 65536"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8,
          num_experts_per_tok=10**15), "num_experts_per_tok=1000000000000000 must be at most"),
    (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=10**10),
     "num_experts=10000000000 must be at most 65536"),
    (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
          num_hidden_layers=10**11), "num_hidden_layers=100000000000"),
]


@pytest.mark.parametrize("fields,message", MOE_BOMBS, ids=["mixtral", "top-k", "qwen", "layers"])
def test_huge_expert_counts_are_refused_before_allocating(hf_dir, tmp_path, fields, message):
    import json
    raw = json.loads((hf_dir / "config.json").read_text())
    raw.update(fields)
    (hf_dir / "config.json").write_text(json.dumps(raw))
    code, err, seconds = run_bounded(["-m", "mpipar.hf", "convert", str(hf_dir),
                                      str(tmp_path / "out")], tmp_path, memory=2 << 30, timeout=60)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and seconds < 30 and not (tmp_path / "out").exists()
    code, err, seconds = run_bounded(["-m", "mpipar.hf", "inspect", str(hf_dir)], tmp_path,
                                     memory=2 << 30, timeout=60)
    assert code in (1, 2) and "Traceback" not in err and seconds < 30, err


# -------------------------------------------------- Hugging Face tensors larger than memory
def _sparse_giant(hf_dir, vocab: int) -> int:
    """Rewrite ``hf_dir`` for a vocabulary of ``vocab``: its embedding and head declared
    ``[vocab, 32]`` float32 in a sparse file whose holes were never written (what a crafted
    file, or a model larger than the node, declares). Returns the bytes the file declares."""
    import json
    import os
    import struct

    from mpipar.checkpoint.huggingface import read_config_json
    from mpipar.checkpoint.safetensors_format import read_header
    file = hf_dir / "model.safetensors"
    header, start = read_header(file)
    data = file.read_bytes()[start:]
    big = {n for n in header if n in ("model.embed_tokens.weight", "lm_head.weight")}
    out, at, chunks = {"__metadata__": header.get("__metadata__", {})}, 0, []
    for name in [n for n in header if n not in big and n != "__metadata__"] + sorted(big):
        entry = dict(header[name])
        begin, end = entry["data_offsets"]
        size = vocab * 32 * 4 if name in big else end - begin
        if name in big:
            entry["shape"] = [vocab, 32]
        else:
            chunks.append(data[begin:end])
        entry["data_offsets"] = [at, at + size]
        out[name], at = entry, at + size
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    os.truncate(file, 8 + len(text) + at)
    raw = read_config_json(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(dict(raw, vocab_size=vocab)))
    return at


def test_a_tensor_larger_than_memory_is_refused_before_it_is_read(hf_dir, tmp_path, capsys,
                                                                   monkeypatch):
    """``hf convert`` streams one tensor at a time, and a tensor that does not fit in the memory
    this node has available is refused naming it, the bytes and the rule, before any tensor is
    read or anything written (a 12 KB sparse safetensors file declaring 32 GB)."""
    from mpipar.checkpoint import hf_convert
    from mpipar.hf import main as hf_main
    from mpipar.runtime import host_memory
    declared = _sparse_giant(hf_dir, 1 << 25)          # two tensors of 4 GiB
    assert declared > 8 << 30 and (hf_dir / "model.safetensors").stat().st_blocks * 512 < 1 << 20
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 2 << 30)
    monkeypatch.setattr(hf_convert, "_read_file", lambda *a: pytest.fail("read a tensor"))
    assert hf_main(["convert", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert ("tensor model.embed_tokens.weight [33554432, 32] needs 8,589,934,592 bytes of "
            "memory to convert (read as F32, written as float32); this node has 2,147,483,648 "
            "bytes available: a tensor must fit in memory") in err, err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_an_output_larger_than_the_free_space_is_refused(hf_dir, tmp_path, capsys, monkeypatch):
    """The output is admitted against the space free where it goes, before anything is
    written."""
    from mpipar.checkpoint import hf_convert
    from mpipar.hf import main as hf_main
    monkeypatch.setattr(hf_convert, "_free_bytes", lambda path: 1000)
    assert hf_main(["convert", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'out'}: the converted model takes 139,904 bytes, but its filesystem has " \
           f"1,000 bytes free" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_convert_holds_one_tensor_at_a_time(hf_dir, tmp_path, monkeypatch):
    """A model larger than the memory available converts when each tensor fits: every read is
    one tensor, written before the next is read, and the output equals the source's tensors
    (cast to the dtype asked for)."""
    import numpy as np

    from mpipar.checkpoint import hf_convert
    from mpipar.checkpoint.huggingface import load_hf
    from mpipar.hf import main as hf_main
    from mpipar.runtime import host_memory
    reads, real = [], hf_convert._read_file

    def one(file, names):
        assert len(names) == 1 and (tmp_path / "out").exists() is False
        reads.append(names[0])
        return real(file, names)

    monkeypatch.setattr(hf_convert, "_read_file", one)
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 100_000)  # < the model
    assert hf_main(["convert", str(hf_dir), str(tmp_path / "out"), "--dtype", "float64"]) == 0
    cfg, want = load_hf(hf_dir)
    _, got = load_hf(tmp_path / "out")
    assert len(reads) == len(want) and 2 * sum(v.nbytes for v in want.values()) > 100_000
    for name, value in want.items():
        assert got[name].dtype == np.float64
        np.testing.assert_array_equal(got[name], value.astype(np.float64))
