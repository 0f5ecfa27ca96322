"""``mpipar.report`` in process: PNGs of a run directory written by hand (:mod:`report_records`),
and the run's summary (:mod:`mpipar.observe.summary`) that names the right bottleneck. The CLI
and a real run's report: e2e/test_report.py."""
from __future__ import annotations

import os

import pytest

from mpipar import report
from mpipar.observe import plots
from mpipar.observe import summary as run_summary
from mpipar.observe.metrics import TIME_KEYS
from report_records import PLOTS, png_size, record, write_run_dir


def _timeline() -> dict:
    """Two pipeline ranks, one microbatch: rank 1 waits 0.25 s of its 1 s, rank 0 0.5 of 1."""
    return {"step": 3, "ranks": [
        {"rank": 0, "coord": {"dp": 0, "tp": 0, "pp": 0, "sp": 0},
         "ops": [["fwd", 0, 0, 0.0, 0.25], ["send_fwd", 0, 0, 0.25, 0.25],
                 ["recv_bwd", 0, 0, 0.25, 0.75], ["bwd", 0, 0, 0.75, 1.0]]},
        {"rank": 1, "coord": {"dp": 0, "tp": 0, "pp": 1, "sp": 0},
         "ops": [["recv_fwd", 0, 0, 0.0, 0.25], ["fwd", 0, 0, 0.25, 0.5],
                 ["bwd", 0, 0, 0.5, 1.0], ["send_bwd", 0, 0, 1.0, 1.0]]}]}


def test_plots_are_valid_pngs(tmp_path):
    records = [record(s, 5.0 - 0.1 * s, compute=0.2, pipeline_wait=0.1) for s in range(1, 6)]
    records[2]["skipped"], records[2]["grad_norm"] = True, float("nan")
    run = write_run_dir(tmp_path, records, _timeline())
    written, text = report.write_report(run)
    for name in PLOTS:
        path = os.path.join(run, "report", f"{name}.png")
        assert path in written and os.path.getsize(path) > 1000
        width, height = png_size(path)
        assert width >= 600 and height >= 150
    assert open(os.path.join(run, "report", "summary.txt")).read() == text


def test_summary_numbers(tmp_path):
    records = [record(1, 5.5, compute=1.0), record(2, 4.0, compute=0.25, dp_comm=0.25),
               record(3, float("nan"), compute=0.25, dp_comm=0.25),
               record(4, 3.0, compute=0.25, dp_comm=0.75)]
    records[2]["skipped"], records[2]["skipped_steps"], records[3]["skipped_steps"] = True, 1, 1
    s = run_summary.summarize(records, _timeline(), {"parallel": {"dp": 1, "pp": 2}})
    assert s["steps"] == [1, 4] and s["loss_first"] == 5.5 and s["loss_min"] == 3.0
    assert s["loss_last"] == pytest.approx((5.5 + 4.0 + 3.0) / 3)   # the skipped NaN left out
    assert s["time_s"]["dp_comm"] == pytest.approx((0.25 + 0.25 + 0.75) / 3)  # after step 1
    assert s["step_time_s"] == 0.5 and s["skipped_steps"] == 1
    assert s["bubble"] == pytest.approx((0.5 + 0.25) / 2)            # from the timeline


def test_the_summary_says_what_the_optimizer_step_costs():
    """Rank 0's measured optimizer seconds and bytes: medians over the steps after the warm-up,
    the seconds' share of the median step, named with the optimizer; a log without them (an
    older run) has no such line."""
    records = [record(s, 5.0 - s, compute=0.2) for s in range(1, 5)]
    for r, (sec, sent, step) in zip(records, [(9.0, 7, 9.0), (0.1, 40, 0.5), (0.3, 20, 0.5),
                                               (0.2, 20, 1.0)]):
        r["optimizer_s"], r["optimizer_bytes"], r["step_time_s"] = sec, sent, step
    s = run_summary.summarize(records, None, {"train": {"optimizer": "muon"}})
    assert s["optimizer_cost"] == {"optimizer": "muon", "seconds": 0.2, "share": 0.4,
                                   "bytes": 20}
    assert ("optimizer (muon, rank 0, median): 0.2 s a step (40.0% of the median step), 20 "
            "bytes a step handed to MPI") in run_summary.summary_text(s).splitlines()
    for r in records:
        del r["optimizer_s"], r["optimizer_bytes"]
    older = run_summary.summarize(records)
    assert "optimizer_cost" not in older and "optimizer (" not in run_summary.summary_text(older)


def _summary(layout: dict, **time) -> dict:
    t = {k: 0.0 for k in TIME_KEYS} | time
    return {"time_s": t, "layout": layout, "bubble": 0.0, "mfu": 0.2, "memory_bytes": [],
            "skipped_steps": 0}


def test_diagnosis_pipeline_bubble():
    s = _summary({"dp": 1, "tp": 1, "pp": 4, "sp": 1, "microbatches": 4}, compute=1.0,
                 pipeline_wait=1.2)
    s["bubble"] = 0.45
    lines = run_summary.diagnose(s)
    assert lines[0] == "bottleneck: pipeline wait (bubble and transfers) (55% of the step time)"
    assert "pipeline bubble 45% > 30%: use more microbatches (now 4 per step for pp=4)" in lines[1]
    assert "--schedule interleaved --virtual-stages 2" in lines[1]


@pytest.mark.parametrize("layout,layers,advice", [
    ({"schedule": "interleaved", "virtual_stages": 2, "micro_batch_size": 1}, 16,
     "use more microbatches (now 8 per step for pp=2) with a larger --global-batch-size, or more "
     "virtual stages (--virtual-stages 4, now 2), or --schedule zb-h1"),
    ({"schedule": "interleaved", "virtual_stages": 2, "micro_batch_size": 2}, 4,
     "use more microbatches (now 8 per step for pp=2) with a smaller --micro-batch-size, or "
     "--schedule zb-h1"),
    ({"schedule": "zb-h1", "virtual_stages": 1, "micro_batch_size": 2}, 6,
     "use more microbatches (now 8 per step for pp=2) with a smaller --micro-batch-size, or "
     "interleaving (--schedule interleaved --virtual-stages 3)"),
    ({"schedule": "1f1b", "virtual_stages": 1, "micro_batch_size": 2}, 4,
     "use more microbatches (now 8 per step for pp=2) with a smaller --micro-batch-size, or "
     "interleaving (--schedule interleaved --virtual-stages 2), or --schedule zb-h1"),
])
def test_bubble_advice_starts_from_what_the_run_did(layout, layers, advice):
    """A run that already used --schedule interleaved --virtual-stages 2 was
    told to use exactly that; the advice now names only what the run did not do (more virtual
    stages when the layers divide, zb-h1, more microbatches)."""
    mbs = layout.pop("micro_batch_size")
    config = {"model": {"layers": layers},
              "parallel": {"dp": 1, "tp": 1, "pp": 2, "sp": 1, **layout},
              "train": {"global_batch_size": 8 * mbs, "micro_batch_size": mbs}}
    records = [record(k, 4.0, compute=1.0, pipeline_wait=1.0) for k in (1, 2)]
    summary = run_summary.summarize(records, None, config)  # what train and mpipar.report run
    line = next(x for x in run_summary.diagnose(summary) if x.startswith("pipeline bubble"))
    assert line == f"pipeline bubble 50% > 30%: {advice}"


def test_summary_layout_names_zero3_in_node_shared_memory():
    """The summary's layout says where ZeRO-3's parameters live when not gathered (and only
    then: the default adds nothing)."""
    records = [record(k, 1.0, compute=1.0) for k in (1, 2)]
    for shared, want in (("node", {"zero": 3, "zero_shared": "node"}), ("off", {"zero": 3})):
        config = {"parallel": {"dp": 2, "zero": 3, "zero_shared": shared}, "train": {}}
        layout = run_summary.summarize(records, None, config)["layout"]
        assert {k: layout[k] for k in layout if k.startswith("zero")} == want


def test_diagnosis_small_bubble_is_not_flagged():
    s = _summary({"pp": 4}, compute=1.0, pipeline_wait=0.2)
    s["bubble"] = 0.2
    assert run_summary.diagnose(s)[0].startswith("bottleneck: compute")
    assert not any("bubble" in line for line in run_summary.diagnose(s)[1:])


def test_diagnosis_tensor_parallel_communication():
    lines = run_summary.diagnose(_summary({"dp": 2, "tp": 4, "pp": 1, "sp": 1}, compute=0.3,
                                     tp_comm=0.6))
    assert lines[0] == "bottleneck: TP communication (67% of the step time)"
    assert "use a smaller --tp (e.g. --tp 2)" in lines[1]


def test_diagnosis_sequence_and_data_parallel():
    lines = run_summary.diagnose(_summary({"dp": 4, "sp": 2}, compute=1.0, sp_comm=0.8, dp_comm=1.2))
    assert lines[0] == "bottleneck: DP gradient communication (40% of the step time)"
    assert any("smaller --sp" in line for line in lines)
    assert any("gradient reduction over dp x sp takes 40%" in line for line in lines)


def test_diagnosis_optimizer_io_skips_memory():
    s = _summary({"dp": 4}, compute=1.0, optimizer=1.0, io=0.5)
    s["skipped_steps"], s["memory_bytes"] = 2, [100 * 2**20, 400 * 2**20]
    lines = run_summary.diagnose(s)
    assert lines[0] == "bottleneck: compute (40% of the step time)"
    assert any("--zero 1 shards it over dp x sp" in line for line in lines)
    assert any("checkpoint less often" in line for line in lines)
    assert any(line.startswith("2 step(s) were skipped") for line in lines)
    assert any("rank 1 peaks at 400 MiB, rank 0 at 100 MiB" in line for line in lines)


def test_diagnosis_compute_bound():
    lines = run_summary.diagnose(_summary({"dp": 8, "backend": "numpy"}, compute=1.0, dp_comm=0.1))
    assert lines == ["bottleneck: compute (91% of the step time)",
                     "compute-bound at MFU 20.0%: larger microbatches use the GEMMs better; "
                     "--backend auto (numba, or cupy on a GPU) is faster than numpy"]
    # Already on the fast kernels: no advice to switch.
    lines = run_summary.diagnose(_summary({"dp": 8, "backend": "numba"}, compute=1.0, dp_comm=0.1))
    assert lines[1] == "compute-bound at MFU 20.0%: larger microbatches use the GEMMs better"


def test_an_mfu_over_100_percent_is_flagged_with_its_likely_cause(capsys):
    from mpipar.observe.metrics import Progress
    records = [record(s, 5.0, compute=0.2) for s in (1, 2, 3)]
    records[1]["mfu"], records[2]["mfu"] = 4.39, 1.2
    s = run_summary.summarize(records)
    assert s["mfu_over_100"] == 2
    text = run_summary.summary_text(s)
    assert "MFU 279.50% (> 100%: not a real rate)" in text
    assert ("2 step(s) report an MFU over 100%: an MFU over 100% is a measurement problem, "
            "not speed: the peak probe was disturbed") in text
    assert "threads oversubscribe the cores" in text
    progress = Progress(total=3, start=0, every=1, enabled=True, tty=False)
    for r in records:
        progress.update(r)
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("MFU 439.00% (> 100%: not a real rate)")
    assert out[2].startswith("step 2: an MFU over 100% is a measurement problem")
    assert out[3].endswith("MFU 120.00% (> 100%: not a real rate)") and len(out) == 4  # once
    assert not any("MFU over 100%" in line for line in run_summary.diagnose(
        run_summary.summarize(records[:1])))


def test_the_report_knows_the_sliding_window():
    """The summary names the window, and SP-bound runs with one are advised the halo
    exchange (whose bytes grow with the window, not the sequence); without one, they are not."""
    config = {"model": {"layers": 4, "sliding_window": 64, "window_layers": "even"},
              "parallel": {"dp": 1, "tp": 1, "pp": 1, "sp": 4, "sp_mode": "ring"},
              "train": {"seq_len": 1024, "global_batch_size": 4, "micro_batch_size": 1}}
    records = [record(k, 4.0, compute=1.0, sp_comm=0.9) for k in (1, 2)]
    summary = run_summary.summarize(records, None, config)
    assert summary["window"] == {"sliding_window": 64, "window_layers": "even", "seq_len": 1024}
    text = run_summary.summary_text(summary)
    assert "attention: sliding window 64 of seq_len 1024 on layers even" in text
    advice = next(x for x in run_summary.diagnose(summary) if x.startswith("SP communication"))
    assert "--sp-mode halo" in advice and "64 tokens" in advice
    config["parallel"]["sp_mode"] = "halo"
    assert not any("--sp-mode halo" in x for x in run_summary.diagnose(run_summary.summarize(records, None,
                                                                                   config)))
    del config["model"]["sliding_window"]
    full = run_summary.summarize(records, None, config)
    assert "window" not in full and "attention: full causal" in run_summary.summary_text(full)
    assert not any("halo" in x for x in run_summary.diagnose(full))


def test_the_report_knows_packed_documents_and_their_balance():
    """A document-masked run says so with its EOS id and which targets carry no loss; the sp
    ranks' attention imbalance is summarised over the steady steps (the first left out) and,
    above 1.10 on average, the split that evens it is named: balanced for the ring, ring with
    balanced (or Ulysses) for hybrid; a balanced run is not told to balance, but is told of
    --sp-min-chunk where that floor kept its chunks fewer than the finest deal's."""
    config = {"model": {"layers": 4},
              "parallel": {"dp": 1, "tp": 1, "pp": 1, "sp": 4, "sp_mode": "ring",
                           "sp_split": "contiguous"},
              "train": {"seq_len": 1024, "global_batch_size": 4, "micro_batch_size": 1,
                        "document_masking": True, "eos_token_id": 2, "eod_mask_loss": True,
                        "loss_mask": False}}
    records = [record(k, 4.0, compute=1.0) for k in (1, 2, 3)]
    for r, x in zip(records, (3.0, 1.5, 1.25)):
        r["attention_imbalance"] = x
    summary = run_summary.summarize(records, None, config)
    assert summary["documents"] == {"eos_token_id": 2}
    assert summary["attention_imbalance"] == {"mean": 1.375, "max": 1.5}
    text = run_summary.summary_text(summary)
    assert ("attention: document-masked (documents end at EOS id 2), full causal within each "
            "document; work over the sp ranks max/mean 1.375 on average, 1.500 at worst") in text
    assert "(targets: all but EOS inputs (--eod-mask-loss))" in text
    advice = [x for x in run_summary.diagnose(summary) if x.startswith("attention work")]
    assert advice == ["attention work is uneven over the sp ranks (max/mean 1.38 on average): "
                      "--sp-split balanced deals each microbatch's documents so that every "
                      "rank's work is equal"]
    config["parallel"].update(sp_mode="hybrid")
    advice = [x for x in run_summary.diagnose(run_summary.summarize(records, None, config))
              if x.startswith("attention work")]
    assert len(advice) == 1 and "--sp-mode ring --sp-split balanced" in advice[0] \
        and "--sp-mode ulysses" in advice[0]
    config["parallel"].update(sp_mode="halo")
    advice = [x for x in run_summary.diagnose(run_summary.summarize(records, None, config))
              if x.startswith("attention work")]
    assert len(advice) == 1 and "--sp-mode ring --sp-split balanced" in advice[0] \
        and "only the window's" in advice[0] and "ulysses" not in advice[0]
    config["parallel"].update(sp_mode="ring", sp_split="balanced")
    config["train"]["seq_len"] = 8192        # 2048 tokens a rank: 32 chunks of the floor's 64
    assert not any(x.startswith("attention work") for x in
                   run_summary.diagnose(run_summary.summarize(records, None, config)))
    config["parallel"]["sp_min_chunk"] = 128                     # 16 chunks where 32 could be
    advice = [x for x in run_summary.diagnose(run_summary.summarize(records, None, config))
              if x.startswith("attention work")]
    assert advice == ["attention work is uneven over the sp ranks (max/mean 1.38 on average): "
                      "--sp-split balanced cut a rank's 2048 tokens into at most 16 chunk(s) "
                      "(--sp-min-chunk 128); a smaller --sp-min-chunk deals finer chunks, at a "
                      "kernel call per pair of a rank's runs in each ring block"]
    del config["parallel"]["sp_min_chunk"]
    config["train"]["seq_len"] = 1024        # the default floor: 4 chunks of 256 tokens a rank
    assert any("into at most 4 chunk(s) (--sp-min-chunk 64)" in x for x in
               run_summary.diagnose(run_summary.summarize(records, None, config)))
    for r in records:
        r["attention_imbalance"] = 1.05
    config["parallel"]["sp_split"] = "contiguous"
    assert not any(x.startswith("attention work") for x in
                   run_summary.diagnose(run_summary.summarize(records, None, config)))
    config["train"]["eos_token_id"] = -1    # the default: the data's recorded EOS
    assert "document-masked (documents end at the EOS token the data records)" in \
        run_summary.summary_text(run_summary.summarize(records, None, config))
    config["train"].update(document_masking=False, eod_mask_loss=False, loss_mask=True)
    plain = run_summary.summarize(records, None, config)
    assert "documents" not in plain and plain["loss_targets"] == (
        "all but prompt tokens (--loss-mask: completions only)")
    config["train"]["document_masking"] = "yes"
    with pytest.raises(ValueError, match=r"train.document_masking='yes' must be true or false"):
        run_summary._check_config(config, "config.toml")


def test_balance_plot_draws_the_recorded_imbalances(tmp_path):
    """balance.png exists only for a run that records balance, and draws exactly the recorded
    attention imbalance and expert loads per step."""
    records = [record(s, 5.0 - 0.1 * s, compute=0.2) for s in range(1, 5)]
    (tmp_path / "plain").mkdir()
    run = write_run_dir(tmp_path / "plain", records, _timeline())
    written, _ = report.write_report(run)
    assert not any(p.endswith("balance.png") for p in written)
    for s, r in enumerate(records, 1):
        r["attention_imbalance"] = 1.0 + 0.1 * s
        r["moe_load_max_over_mean"] = {"1": 2.0 - 0.2 * s, "3": 1.5}
    series = plots.balance_series(records)
    assert series == {"attention work, sp ranks": ([1, 2, 3, 4], [1.1, 1.2, 1.3, 1.4]),
                      "expert load, layer 1": ([1, 2, 3, 4], [1.8, 1.6, 1.4, 1.2]),
                      "expert load, layer 3": ([1, 2, 3, 4], [1.5] * 4)}
    (tmp_path / "balanced").mkdir()
    run = write_run_dir(tmp_path / "balanced", records, _timeline())
    written, _ = report.write_report(run)
    path = os.path.join(run, "report", "balance.png")
    assert path in written and os.path.getsize(path) > 1000 and png_size(path)[0] >= 600


def test_balance_title_names_only_what_the_run_records():
    assert plots.balance_title({"expert load, layer 1": ([1], [2.0])}) == (
        "Balance: expert load per sparse layer")
    assert plots.balance_title({"attention work, sp ranks": ([1], [1.1])}) == (
        "Balance: attention work over sp ranks")


def test_an_moe_summary_names_the_expert_exchange_and_the_balance():
    """The experts' all-to-all is a time category of its own, so an EP-heavy step is not
    called compute-bound; the balance line gives the aux loss and each sparse layer's load
    against the ceiling experts / top-k, naming the collapsed layers and the remedy."""
    records = [record(s, 5.0, compute=0.2, ep_comm=0.18, optimizer=0.02) for s in range(1, 8)]
    for r in records:
        r["moe_aux_loss"] = 0.004
        r["moe_load_max_over_mean"] = {"1": 1.25, "2": 2.0, "3": 1.96}
    config = {"model": {"layers": 4, "moe_experts": 4, "moe_top_k": 2, "moe_aux_loss_coef": 0.001},
              "parallel": {"dp": 2}}
    s = run_summary.summarize(records, None, config)
    assert s["time_s"]["ep_comm"] == pytest.approx(0.18)
    b = s["moe_balance"]
    assert b["steps"] == 5 and b["ceiling"] == 2.0 and b["collapsed"] == ["2", "3"]
    assert b["aux_loss"] == pytest.approx(0.004) and b["load"]["1"] == pytest.approx(1.25)
    text = run_summary.summary_text(s)
    assert ("expert balance (mean of the last 5 steps): balance loss 0.004, load max/mean per "
            "sparse layer 1: 1.25, 2: 2.00, 3: 1.96 (ceiling experts / top-k = 2); collapsed: "
            "layer(s) 2, 3") in text
    lines = run_summary.diagnose(s)
    assert lines[0] == "bottleneck: compute (50% of the step time)"
    assert any(x.startswith("the experts' all-to-all takes 45% of the step") for x in lines)
    assert any(x.startswith("the router collapsed in sparse layer(s) 2, 3") and
               "raise --moe-aux-loss-coef (now 0.001), or loss-free balancing with "
               "--moe-bias-update-rate" in x for x in lines)
    assert "ep_comm 0.18 s (45%)" in text
    dense = run_summary.summarize([record(s, 5.0, compute=0.2) for s in (1, 2)])
    assert "moe_balance" not in dense and "expert balance" not in run_summary.summary_text(dense)


def test_a_record_without_ep_comm_still_reads():
    r = record(1, 5.0, compute=0.2)
    del r["time"]["ep_comm"]
    run_summary._check_record(r, "metrics.jsonl")
    assert run_summary.summarize([r])["time_s"]["ep_comm"] == 0.0


def test_the_report_without_matplotlib_prints_the_diagnosis_and_says_how_to_plot(
        tmp_path, monkeypatch, capsys):
    import sys
    run = write_run_dir(tmp_path, [record(s, 5.0 - 0.1 * s, compute=0.2) for s in (1, 2, 3)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib: ImportError
    assert report.main([run]) == 0
    out = capsys.readouterr().out
    assert "bottleneck: compute" in out and "pip install 'mpipar[report]'" in out
    assert os.listdir(os.path.join(run, "report")) == ["summary.txt"]


def test_the_time_breakdown_books_the_experts_exchange_apart_from_compute():
    from types import SimpleNamespace
    from mpipar.observe.metrics import time_breakdown
    ops = [SimpleNamespace(kind="fwd", start=0.0, end=0.25),
           SimpleNamespace(kind="bwd", start=0.25, end=0.75)]
    t = time_breakdown(1.0, {"ep": 0.25, "tp": 0.125, "dp_sp": 0.125}, ops)
    assert t["ep_comm"] == 0.25 and t["tp_comm"] == 0.125
    assert t["compute"] == pytest.approx(0.75 - 0.25 - 0.125)       # the ops less ep and tp
    assert t["optimizer"] == pytest.approx(1.0 - 0.75 - 0.125)       # the rest of the step
    assert sum(t.values()) == pytest.approx(1.0)


def test_a_warm_up_step_reports_no_throughput(capsys):
    """A process's first step, fresh or resumed (compilation, first touches), measures no
    throughput: it is marked ``warmup``, the step line says so, and the summary's medians, the
    throughput and time plots leave it out."""
    from mpipar.observe.metrics import Progress
    records = [record(s, 5.0, compute=2.0 if s in (1, 4) else 0.25) for s in range(1, 7)]
    records[0]["warmup"] = records[3]["warmup"] = True
    assert [r["step"] for r in run_summary.steady_records(records)] == [2, 3, 5, 6]
    s = run_summary.summarize(records)
    assert s["tokens_per_s"] == 4096 / 0.25 and s["step_time_s"] == 0.25
    assert "throughput (medians without warm-up steps): 16,384 tokens/s" in (
        run_summary.summary_text(s))
    progress = Progress(total=6, start=0, every=5, enabled=True, tty=False)
    for r in records:
        progress.update(r)
    out = capsys.readouterr().out.splitlines()
    assert [line.split("/")[0] for line in out] == ["step      1", "step      4", "step      5",
                                                     "step      6"]
    assert out[1].endswith("lr 1.00e-03  warm-up step 2 s (compiling, first touches: no "
                           "throughput)"), out[1]
    assert out[2].endswith("16,384 tok/s  MFU 4.00%"), out[2]


def test_a_recovery_is_named_in_the_summary_and_marked_on_the_plots():
    """A metrics line carrying ``recovered`` (--on-rank-failure shrink): the report's summary
    names the failure (step, ranks lost, old and new layout, seconds, steps redone, the state's
    source, the flags to go on with) and the loss and throughput plots mark it half a step
    before the first step trained after it."""
    records = [record(s, 5.0 - 0.1 * s, compute=0.2) for s in range(1, 6)]
    records[3]["recovered"] = {
        "failed_ranks": [2], "failed_step": 4, "from": "checkpoint", "resumed_step": 2,
        "steps_redone": 2, "old_world": 4, "world": 3, "seconds": 1.25,
        "old_layout": "dp=2 tp=1 pp=2 sp=1 ep=1 zero=0", "layout": "dp=3 tp=1 pp=1 sp=1 ep=1 zero=0",
        "layout_flags": "--dp 3 --tp 1 --pp 1"}
    text = run_summary.summary_text(run_summary.summarize(records))
    assert ("recovery in step 4: rank(s) [2] lost (4 -> 3 ranks, dp=2 tp=1 pp=2 sp=1 ep=1 "
            "zero=0 -> dp=3 tp=1 pp=1 sp=1 ep=1 zero=0); state of step 2 restored from "
            "checkpoint, 2 step(s) redone; 1.25 s to recover; go on with --dp 3 --tp 1 --pp 1"
            ) in text.splitlines()
    summary = run_summary.summarize(records)
    assert summary["recoveries"] == [{**records[3]["recovered"], "step": 4}]
    assert plots.recovery_marks(records) == [(3.5, "ranks 4 -> 3")]
    assert "recover" not in run_summary.summary_text(run_summary.summarize(records[:3]))
