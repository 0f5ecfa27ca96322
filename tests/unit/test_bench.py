"""`python -m mpipar.bench` in process: `gpu --static` (the compile gate's arguments and status) and
the compression section's rows (means over seeds against none of the same seed and layout), and
the documents section's speed ratios (against a pair-by-pair count of the work)."""

from __future__ import annotations

import pytest

from mpipar.bench.__main__ import main

pytest.importorskip("numba")


def test_gpu_static_returns_the_compile_gates_status(tmp_path, monkeypatch):
    """``gpu --static`` runs no benchmark: it hands --arch and --json to the compile gate and
    returns the gate's status."""
    from mpipar.kernels import cuda_gate

    calls = []
    monkeypatch.setattr(cuda_gate, "main", lambda argv: calls.append(argv) or 1)
    path = str(tmp_path / "gate.json")
    assert main(["gpu", "--static", "--arch", "sm_90", "--json", path]) == 1
    assert main(["gpu", "--static"]) == 1
    assert calls == [["--arch", "sm_90", "--json", path], []]
    assert not (tmp_path / "gate.json").exists()  # the gate writes its own report, not the bench


def test_compression_rows_are_means_over_seeds_against_none_of_the_same_seed_and_layout():
    from mpipar.bench.compression import _layout_flags, _summarise

    def run(layout, variant, seed, final, first=1.0, wire=100):
        return {"layout": layout, "variant": variant, "seed": seed, "final_loss": final,
                "first_loss": first, "wire_bytes": wire, "inter_node_bytes": wire // 2,
                "step_time_s": 0.1, "losses": [final]}
    runs = [run("flat", "none", 1, 2.0), run("flat", "none", 2, 4.0),
            run("flat", "int8", 1, 2.2, 1.1, 25), run("flat", "int8", 2, 3.6, 1.0, 25),
            run("hier4", "none", 1, 1.0), run("hier4", "int8", 1, 1.5, 1.0, 50)]
    rows = _summarise(runs, ["none", "int8"], ["flat", "hier4"])
    flat = rows[1]
    assert (flat["layout"], flat["variant"], flat["seeds"]) == ("flat", "int8", [1, 2])
    assert flat["vs_none_per_seed"] == pytest.approx([0.1, -0.1])
    assert flat["vs_none"] == pytest.approx(0.0) and flat["first_vs_none"] == pytest.approx(0.05)
    assert flat["final_loss"] == pytest.approx(2.9) and flat["bytes_ratio"] == 4.0
    assert rows[3]["vs_none"] == pytest.approx(0.5) and rows[3]["bytes_ratio"] == 2.0
    assert _layout_flags("hier4") == ["--ranks-per-node", "4", "--dp-reduce", "hierarchical"]
    assert _layout_flags("flat") == []


def test_precision_means_over_seeds_and_per_seed_differences():
    """The precision section's seed means: each variant's final losses averaged over the seeds
    against float32's average, and the mean +- standard error of the per-seed differences
    (hand-computed)."""
    import math
    from mpipar.bench.precision import _against, _seed_means

    runs = {}
    for seed, (f32, bf16) in {1: (2.0, 2.1), 2: (1.0, 0.98)}.items():
        rows = [{"variant": "float32", "final_loss": f32, "bytes": 10},
                {"variant": "bfloat16", "final_loss": bf16, "bytes": 10}]
        _against(rows, rows[0], 0.01)
        runs[seed] = rows
    assert [r["tracks"] for r in runs[1]] == [True, False]
    assert math.isclose(runs[2][1]["vs_float32"], -0.02)
    means = _seed_means(runs, ["float32", "bfloat16"])
    bf16 = means[1]
    assert math.isclose(bf16["final_loss"], 1.54)
    assert math.isclose(bf16["vs_float32"], 1.54 / 1.5 - 1)            # of the means: +2.67 %
    assert math.isclose(bf16["diff_mean"], (0.05 - 0.02) / 2)          # of the seeds: +1.5 %
    assert math.isclose(bf16["diff_stderr"], math.sqrt(2 * 0.035 ** 2) / math.sqrt(2))
    assert means[0]["vs_float32"] == 0.0 and means[0]["diff_stderr"] == 0.0


def test_muon_section_reads_runs_and_compares_means_over_seeds():
    """The muon section's numbers: a run's final loss, optimizer seconds, share and bytes from
    its records (the warm-up step left out of the medians); the sweep's best rate (a diverged
    rate never wins); the means over the seeds and Muon's per-seed differences from AdamW
    (hand-computed)."""
    import math
    from mpipar.bench.muon import best_lr, run_numbers, seed_means

    def rec(loss, step, opt, sent):
        return {"loss": loss, "step_time_s": step, "optimizer_s": opt, "optimizer_bytes": sent,
                "comm_bytes": {"dp_sp": 1000, "tp": 24}}
    got = run_numbers([rec(5.0, 9.0, 9.0, 7), rec(4.0, 1.0, 0.1, 0), rec(3.0, 2.0, 0.9, 10),
                       rec(2.0, 6.0, 0.2, 50)], last=2)
    assert got["final_loss"] == 2.5 and got["step_time_s"] == 2.0
    assert got["optimizer_s"] == 0.2 and math.isclose(got["optimizer_share"], 0.1)
    assert got["optimizer_bytes"] == 10 and got["step_bytes"] == 1024
    assert best_lr([{"lr": 1e-2, "final_loss": float("nan")}, {"lr": 3e-3, "final_loss": 2.0},
                    {"lr": 1e-3, "final_loss": 2.5}]) == 3e-3
    with pytest.raises(SystemExit):
        best_lr([{"lr": 1.0, "final_loss": float("inf")}])

    def row(opt, seed, final):
        return {"optimizer": opt, "seed": seed, "lr": 0.02 if opt == "muon" else 3e-3,
                "final_loss": final, "step_time_s": 1.0, "optimizer_s": 0.1,
                "optimizer_share": 0.1, "optimizer_bytes": 8, "step_bytes": 100}
    means = seed_means([row("adamw", 1, 2.0), row("muon", 1, 1.8), row("adamw", 2, 1.0),
                        row("muon", 2, 1.1)])
    assert math.isclose(means["adamw"]["final_loss"], 1.5)
    assert math.isclose(means["adamw"]["final_loss_sd"], math.sqrt(0.5))
    assert math.isclose(means["muon"]["final_loss"], 1.45) and means["muon"]["lr"] == 0.02
    assert math.isclose(means["muon"]["vs_adamw"], (-0.1 + 0.1) / 2, abs_tol=1e-15)
    assert math.isclose(means["muon"]["vs_adamw_stderr"], math.sqrt(2 * 0.1 ** 2) / math.sqrt(2))
    assert "vs_adamw" not in means["adamw"] and means["muon"]["optimizer_bytes"] == 8


def test_documents_speed_ratios_rest_on_a_brute_force_pair_count():
    """``documents``'s speed row on the CPU: the work ratio is the intra-document causal pairs
    over the full causal pairs, counted here pair by pair from the ids; the reported ratios are
    the measured times over it; the host's issue time is no more than the wall time; and a
    bf16 attention choice (``--attention cudnn``, a GPU's) leaves the CPU's kernels as they are."""
    import argparse
    import itertools

    import numpy as np

    from mpipar.bench.documents import packed_documents, speed

    args = argparse.Namespace(speed_seq=96, median=12.0, sigma=1.0, seed=3, rows=2, heads=2,
                              head_dim=16, dtype="float64", backend="numba", repeats=2,
                              attention="cudnn")
    got = speed(args)
    rng = np.random.default_rng(3)
    docs = np.concatenate([packed_documents(96, 12.0, 1.0, rng) for _ in range(2)])
    pairs = sum(int(row[i] == row[j]) for row in docs for i in range(96) for j in range(i + 1))
    assert got["work_ratio"] == pytest.approx(pairs / (2 * 96 * 97 / 2), rel=1e-12)
    assert got["documents"] == sum(int(r.max()) + 1 for r in docs)
    assert got["backend"] == "numba" and got["attention"] == "attention: numba kernels"
    assert got["time_over_work"] == pytest.approx(got["masked_s"] / got["full_s"] / pairs
                                                  * (2 * 96 * 97 / 2), rel=1e-12)
    for name in ("full", "masked"):
        assert 0 < got[f"{name}_issue_s"] <= got[f"{name}_s"]
    # cuDNN's ragged grid (128-row query tiles): the documents' runs counted here; one call
    # covers the bucketed count (16 up) x the bucketed longest (64 up); the classes each theirs
    runs = [len(list(g)) for row in docs for _, g in itertools.groupby(row)]
    assert got["cudnn_documents_tiles"] == sum(-(-n // 128) for n in runs)
    one = max(16, 1 << (len(runs) - 1).bit_length()) * -(-max(64, 1 << (max(runs) - 1).bit_length()) // 128)
    assert got["cudnn_grid_tiles"] == one
    classes = {max(64, 1 << (n - 1).bit_length()) for n in runs}
    assert got["cudnn_classes"] == len(classes)


def test_warmup_names_what_it_compiles_and_skips_a_backend_that_compiles_nothing(tmp_path,
                                                                                 capsys):
    """``python -m mpipar.bench warmup`` fills the kernel cache ahead of a job: every op the
    numba backend runs in Numba, none for numpy (which it says)."""
    import json

    from mpipar.bench.__main__ import main
    from mpipar.kernels import get_backend, warmup

    assert warmup.compiled_ops(get_backend("numba")) == [
        "rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd", "rope_fwd",
        "rope_bwd", "swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd", "attention_fwd",
        "attention_bwd", "attention_merge", "cross_entropy_stats", "cross_entropy_bwd"]
    assert not warmup.compiles(get_backend("numpy"))
    out = tmp_path / "w.json"
    assert main(["warmup", "--backend", "numpy", "--json", str(out)]) == 0
    assert "compiles nothing at run time" in capsys.readouterr().out
    assert json.loads(out.read_text())["warmup"]["seconds"] == {}


def test_the_warm_up_parts_call_every_compiled_op_and_are_dealt_a_core_each():
    """A node's first ranks, one a core, compile a part of the kernels each: together the parts
    call every op the numba backend compiles; a rank past the cores or the parts compiles none."""
    import numpy as np

    from mpipar.kernels import get_backend, warmup
    from mpipar.runtime.compile_once import compiling_parts

    called: set[str] = set()

    class Recorder:
        def __init__(self, backend):
            self._backend = backend

        def __getattr__(self, op):
            called.add(op)
            return getattr(self._backend, op)

    warmup.warm_up(Recorder(get_backend("numpy")), np.float32)
    assert set(warmup.compiled_ops(get_backend("numba"))) <= called
    a, b, c = warmup.PARTS
    assert [compiling_parts([0] * 8, r, 2) for r in range(3)] == [(a, c), (b,), ()]
    assert [compiling_parts([0] * 4 + [1] * 4, r, 8) for r in (0, 2, 3, 4, 6, 7)] == [
        (a,), (c,), (), (a,), (c,), ()]
    assert compiling_parts([0], 0, 1) == (a, b, c)
