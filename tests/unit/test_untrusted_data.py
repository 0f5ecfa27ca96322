"""Token data from elsewhere and ``data prepare`` runs that fail, in process: token files that name
other files (external storage, links, virtual datasets) or carry a malformed tokenizer record,
and validation data from another tokenizer, are refused naming the file and the rule; a prepare
that fails (an unreadable input, an output that cannot be a file, text that is not text) exits
2 with one message, and never loses another prepare's output; costs stay linear. Each test
asserts the status, one message, no traceback, and what is left on disk. A full or read-only
filesystem: e2e/test_untrusted_data.py."""
from __future__ import annotations

import builtins
import json
import os
import re
import time

import h5py
import numpy as np
import pytest

from mpipar.data import documents, prepare
from mpipar.data.cli import main
from mpipar.data.prepare import prepare_tokens
from mpipar.data.sources import DataError, load_tokens
from small_tokenizers import bpe, chatml, tokenizer_dir  # noqa: F401  (fixtures)
from untrusted import run_train

SHA = "ab" * 32
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "8",
        "--global-batch-size", "2", "--steps", "1", "--backend", "numpy", "--log-every", "0",
        "--tensorboard", "off"]


def _refused(capsys, argv: list[str], message: str) -> str:
    """``python -m mpipar.data ARGV`` exits 2 printing one line that holds ``message``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    return err


def _tokens_file(path, tokens, **attrs) -> None:
    with h5py.File(path, "w") as f:
        f["tokens"] = np.asarray(tokens, dtype=np.uint16)
        f.attrs.update(attrs)


def _record(vocab: int = 300, sha: str = SHA) -> dict:
    """The tokenizer record ``prepare --tokenizer`` writes."""
    return {"tokenizer": "some/tokenizer", "tokenizer_vocab_size": vocab, "tokenizer_sha256": sha,
            "eos_token": "</s>", "eos_id": 0, "documents": 3}


# ------------------------------------------------------------- token files naming other files
def _external(tmp_path, secret):
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.create_dataset("tokens", shape=(64,), dtype=np.uint8, external=[(str(secret), 0, 64)])


def _external_link(tmp_path, secret):
    _tokens_file(tmp_path / "other.h5", np.arange(64))
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["tokens"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/tokens")


def _soft_link(tmp_path, secret):
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["elsewhere"] = np.arange(64, dtype=np.uint16)
        f["tokens"] = h5py.SoftLink("/elsewhere")


def _virtual(tmp_path, secret):
    layout = h5py.VirtualLayout(shape=(64,), dtype=np.uint16)
    layout[:] = h5py.VirtualSource(str(tmp_path / "missing.h5"), "tokens", shape=(64,))
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.create_virtual_dataset("tokens", layout, fillvalue=0)


@pytest.mark.parametrize("craft,message", [
    (_external, "keeps its bytes in external files"),
    (_external_link, "'tokens' is a link (ExternalLink) to another file"),
    (_soft_link, "'tokens' is a link (SoftLink)"),
    (_virtual, "is a virtual dataset"),
])
def test_a_token_file_that_names_other_files_is_refused(tmp_path, capsys, craft, message):
    """A token dataset must be stored in the file itself: one with external raw storage (which
    would read any file, /etc/passwd, as tokens) or a virtual dataset (whose missing source
    reads as its fill value) exits 2 naming the dataset, nothing read."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 2)
    craft(tmp_path, secret)
    _refused(capsys, ["info", str(tmp_path / "t.h5"), "--seq-len", "8"], message)
    with pytest.raises(DataError, match=re.escape(message)):
        load_tokens(tmp_path / "t.h5", 256, 8)


# ---------------------------------------------------------------- a malformed tokenizer record
@pytest.mark.parametrize("change,message", [
    (dict(tokenizer=None), "the tokenizer record lacks the attribute 'tokenizer'"),
    (dict(tokenizer_vocab_size="300"), "attribute tokenizer_vocab_size='300' must be an integer"),
    (dict(tokenizer_vocab_size=0), "attribute tokenizer_vocab_size=0 must be >= 1"),
    (dict(tokenizer_sha256="abc"), "attribute tokenizer_sha256='abc' must be 64 hexadecimal"),
    (dict(eos_id=300), "attribute eos_id=300 must be in [0, 300)"),
    (dict(eos_token=7), "attribute eos_token=7 must be a string"),
])
def test_a_malformed_tokenizer_record_is_refused(tmp_path, capsys, change, message):
    """Each tokenizer attribute of a token file is checked: ``tokenizer_vocab_size`` without
    ``tokenizer``, or as a string, is refused by ``data info`` and by training with
    ``--data``/``--eval-data``, naming it."""
    attrs = {k: v for k, v in {**_record(), **change}.items() if v is not None}
    _tokens_file(tmp_path / "t.h5", np.arange(64) % 300, **attrs)
    _refused(capsys, ["info", str(tmp_path / "t.h5"), "--seq-len", "8"], message)
    for flag in ("--data", "--eval-data"):
        data = tmp_path / "t.h5" if flag == "--data" else tmp_path / "ok.npy"
        np.save(tmp_path / "ok.npy", np.arange(64) % 300)
        extra = ["--eval-data", str(tmp_path / "t.h5")] if flag == "--eval-data" else []
        code, err = run_train([*TINY, "--vocab-size", "300", "--data", str(data), *extra,
                               "--run-dir", str(tmp_path / "run")])
        assert code == 2 and err.count(message) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "run" / "config.toml").exists()
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------ validation data's origin
@pytest.mark.parametrize("case", ["other tokenizer", "bytes against tokens"])
def test_validation_data_from_another_tokenizer_is_refused(tmp_path, case):
    """``--eval-data`` from another tokenizer with the same vocabulary size, or raw bytes against
    tokenized ``--data``, is refused (both files record their origin; the validation loss
    would mean nothing): exit 2 naming both, before step 1."""
    _tokens_file(tmp_path / "train.h5", np.arange(200) % 256, **_record(256))
    if case == "other tokenizer":
        _tokens_file(tmp_path / "eval.h5", np.arange(200) % 256, **_record(256, "cd" * 32))
        want = "holds ids of the tokenizer some/tokenizer (sha256 cdcdcdcdcdcdcdcd...)"
    else:
        (tmp_path / "eval.txt").write_bytes(bytes(range(256)))
        want = "holds byte tokens (no tokenizer)"
    evals = tmp_path / ("eval.h5" if case == "other tokenizer" else "eval.txt")
    code, err = run_train([*TINY, "--vocab-size", "256", "--data", str(tmp_path / "train.h5"),
                           "--eval-data", str(evals), "--run-dir", str(tmp_path / "run")])
    assert code == 2 and err.count(want) == 1 and "Traceback" not in err, err
    assert "sha256 abababababababab..." in err and "means nothing" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # the same tokenizer, or a source that does not say (.npy), is accepted
    np.save(tmp_path / "eval.npy", np.arange(200) % 256)
    from mpipar.config import TrainConfig
    from mpipar.data.sources import validation
    source = load_tokens(tmp_path / "train.h5", 256, 8)
    for ok in (tmp_path / "train.h5", tmp_path / "eval.npy"):
        validation(source, TrainConfig(seq_len=8, global_batch_size=2, eval_data=str(ok)), 256)


# ------------------------------------------------------------------- two prepares, one --out
def test_two_prepares_with_the_same_out_keep_each_others_files(tmp_path, monkeypatch):
    """Two runs with the same ``--out`` keep each other's files: each writes its own temporary
    file and removes only that. While run A writes, run B fails (its own file removed) and run
    C completes; A then completes too, and its output is whole."""
    first, second = b"first run " * 1000, b"third run " * 10
    (tmp_path / "a.txt").write_bytes(first)
    (tmp_path / "b.txt").write_bytes(b"second run " * 10)
    (tmp_path / "c.txt").write_bytes(second)
    out = tmp_path / "x.h5"
    real, started = prepare._blocks, []

    def blocks(path, size):
        if str(path).endswith("b.txt"):
            raise DataError(f"{path}: cannot be read (Input/output error)")
        for at, block in real(path, size):
            if not started:  # A has created its temporary file and is writing
                started.append(sorted(os.listdir(tmp_path)))
                with pytest.raises(DataError, match="b.txt: cannot be read"):
                    prepare_tokens([tmp_path / "b.txt"], out)
                assert prepare_tokens([tmp_path / "c.txt"], out) == len(second)
                with h5py.File(out) as f:
                    assert bytes(f["tokens"][...]) == second
            yield at, block

    monkeypatch.setattr(prepare, "_blocks", blocks)
    assert prepare_tokens([tmp_path / "a.txt"], out, chunk_tokens=4096) == len(first)
    [temporary] = [n for n in started[0] if n.endswith(".tmp")]
    assert temporary.startswith(".x.h5.")
    with h5py.File(out) as f:
        assert bytes(f["tokens"][...]) == first
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.txt", "x.h5"]


# ------------------------------------------------------------------------- prepare's failures
def _deny(monkeypatch, path) -> None:
    """Opening ``path`` fails as an unreadable file does (the tests may run as root)."""
    real = builtins.open

    def fake(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake)


@pytest.mark.parametrize("tokenized", [False, True], ids=["bytes", "tokenizer"])
def test_an_unreadable_input_is_named_not_the_output(tmp_path, capsys, monkeypatch,
                                                     tokenizer_dir, tokenized):
    """An unreadable input is named, with ``--tokenizer`` and in bytes mode, before anything is
    written (not a traceback, and not blamed on ``--out``)."""
    (tmp_path / "ok.txt").write_text("the cat sat")
    (tmp_path / "locked.txt").write_text("on the mat")
    _deny(monkeypatch, tmp_path / "locked.txt")
    extra = ["--tokenizer", str(tokenizer_dir)] if tokenized else []
    err = _refused(capsys, ["prepare", str(tmp_path / "ok.txt"), str(tmp_path / "locked.txt"),
                            "--out", str(tmp_path / "x.h5"), *extra],
                   f"{tmp_path / 'locked.txt'}: cannot be read (Permission denied)")
    assert "--out" not in err
    assert sorted(os.listdir(tmp_path)) == ["locked.txt", "ok.txt", "tok"]


def test_a_worker_error_is_one_message(tmp_path, capsys, tokenizer_dir):
    """With ``--workers 2`` a worker's input error is the same one message as in one process
    (not a RemoteTraceback), and no part file stays."""
    (tmp_path / "a.txt").write_text("the cat sat")
    (tmp_path / "b.jsonl").write_text('{"text": "the mat"}\n{"text": 5}\n')
    _refused(capsys, ["prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out",
                      str(tmp_path / "x.h5"), "--tokenizer", str(tokenizer_dir), "--workers", "2"],
             f"{tmp_path / 'b.jsonl'}: line 2: field 'text' must be a string, got int")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.jsonl", "tok"]


def test_a_lone_surrogate_in_jsonl_is_named(tmp_path, capsys, tokenizer_dir):
    """JSONL text with a lone surrogate (``"\\ud800"``, common in scraped data) is named: file,
    line, character (not a traceback from inside the tokenizer)."""
    (tmp_path / "d.jsonl").write_text('{"text": "the cat"}\n{"text": "sat \\ud800 on"}\n')
    _refused(capsys, ["prepare", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "x.h5"),
                      "--tokenizer", str(tokenizer_dir)],
             f"{tmp_path / 'd.jsonl'}: line 2: field 'text' holds the lone surrogate U+D800 at "
             f"character 4")
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "tok"]


@pytest.mark.parametrize("target,message", [
    ("outdir.h5", "exists and is not a regular file"),
    ("afile/x.h5", "cannot be written ({tmp}/afile is not a directory)"),
])
def test_an_output_that_cannot_be_a_file_is_refused_before_tokenizing(tmp_path, capsys,
                                                                      monkeypatch, tokenizer_dir,
                                                                      target, message):
    """``--out`` an existing directory, or in an unwritable directory, is refused before any
    input is read."""
    (tmp_path / "outdir.h5").mkdir()
    (tmp_path / "afile").write_text("a file where a directory goes")
    (tmp_path / "in.txt").write_text("the cat sat")
    monkeypatch.setattr(documents, "read_batches", lambda *a, **k: pytest.fail("read an input"))
    _refused(capsys, ["prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / target),
                      "--tokenizer", str(tokenizer_dir)],
             f"--out {tmp_path / target}: {message.format(tmp=tmp_path)}")
    assert sorted(os.listdir(tmp_path / "outdir.h5")) == []


# ------------------------------------------------------------------------- also weak: costs
def test_a_crlf_file_is_scanned_in_linear_time(tmp_path):
    """A CRLF file has no place to cut (module docstring of mpipar.data.documents) and was
    rescanned whole at every block: quadratic. Each block's scan starts where the last ended
    now; the text comes back whole, in one document."""
    text = "the cat sat on the mat\r\n" * 100_000  # 2.4 MB, 100k newlines
    (tmp_path / "crlf.txt").write_bytes(text.encode())
    started = time.perf_counter()
    batches = list(documents.read_batches(str(tmp_path / "crlf.txt"), "text", batch_bytes=4096))
    elapsed = time.perf_counter() - started
    assert [b.texts for b in batches] == [[text]] and batches[0].ends == [True]
    assert elapsed < 5, f"{elapsed:.1f} s for 600 blocks of 4 KiB"  # quadratic: minutes


def test_the_tokenizer_encodes_bounded_text_at_a_time(tmp_path, monkeypatch):
    """Encoding an 8 MiB block peaked at ~2.7 GB a worker (the tokenizer's encodings take
    about 300 bytes a token). Blocks, batches and the groups handed to the tokenizer are now
    at most 1 MiB of text (one longer document alone), and the ids are the same."""
    from mpipar.data.tokenizer import TokenizerSpec, encode_file
    docs = [("w " * (n % 5000 + 1)).strip() for n in range(600)] + ["x " * 700_000]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    sizes: list[int] = []

    class Fake:  # one id per character: the ids say which text they came from
        def encode_batch_fast(self, texts, add_special_tokens):
            sizes.append(sum(map(len, texts)))
            return [type("Encoding", (), {"ids": [len(t) % 7] * len(t)}) for t in texts]

    spec = TokenizerSpec("fake", "fake", 8, SHA, "</s>", 7)
    ids = np.concatenate([ids for ids, _, _ in encode_file(Fake(), spec, str(tmp_path / "d.jsonl"),
                                                           "text")])
    want = np.concatenate([[len(d) % 7] * len(d) + [7] for d in docs])
    assert np.array_equal(ids, want)
    assert documents.BATCH_BYTES == 2**20
    assert max(sizes[:-1]) <= documents.BATCH_BYTES and sizes[-1] == len(docs[-1])


# ------------------------------------------------------------------- data prepare --sft
def _sft(capsys, tmp_path, tokenizer_dir, lines: bytes, message: str, template: str = "") -> None:
    """``data prepare --sft`` of a JSONL file of ``lines`` (its first record good) exits 2 with
    one line naming the file, the line and ``message``; no output is written."""
    if template:
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(json.dumps({"prompt": "the cat", "completion": "sat"}).encode() + b"\n"
                      + lines + b"\n")
    err = _refused(capsys, ["prepare", "--sft", str(pairs), "--tokenizer", str(tokenizer_dir),
                            "--out", str(tmp_path / "out.h5")], f"{pairs}:2: {message}")
    assert "Traceback" not in err and not (tmp_path / "out.h5").exists()


CHAT = json.dumps({"messages": [{"role": "user", "content": "the cat"},
                                {"role": "assistant", "content": "sat"}]}).encode()
SFT_CASES = [
    ("not utf-8", b'{"prompt": "the \xff cat", "completion": "sat"}', "not UTF-8 (byte 16",
     ""),
    ("lone surrogate", b'{"prompt": "the \\ud800 cat", "completion": "sat"}',
     "holds a lone surrogate ('\\ud800'), not text", ""),
    ("surrogate in messages", b'{"messages": [{"role": "user", "content": "\\udfff"}, 1]}',
     "holds a lone surrogate", ""),
    ("deep", b"[" * 100000 + b"]" * 100000, "JSON nested too deeply for a record", ""),
    ("too long", b'{"prompt": "' + b"a" * (2 << 20) + b'", "completion": "x"}',
     "a record longer than 1048576 bytes", ""),
    ("template reads a missing field", CHAT,
     "the chat template failed on the record (UndefinedError",
     "{% for m in messages %}{{ m.content.missing.deeper }}{% endfor %}"),
    ("template raises", CHAT, "the chat template failed on the record (ZeroDivisionError",
     "{{ 1 // 0 }}"),
    ("template reaches past the sandbox", CHAT,
     "the chat template failed on the record (SecurityError",
     "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"),
    ("template does not parse", CHAT, "the chat template failed on the record "
                                      "(TemplateSyntaxError", "{% for m in messages %}"),
]


@pytest.mark.parametrize("name,lines,message,template", SFT_CASES, ids=[c[0] for c in SFT_CASES])
def test_sft_records_that_are_not_records_are_named(capsys, tmp_path, tokenizer_dir, name, lines,
                                                     message, template):
    pytest.importorskip("jinja2")
    start = time.monotonic()
    _sft(capsys, tmp_path, tokenizer_dir, lines, message, template)
    assert time.monotonic() - start < 30


# ------------------------------------------------------- packed documents: EOS ids, masked loss
def _packed(tmp_path, flags: list[str], data, message: str) -> None:
    """A run of ``data`` (a file under ``tmp_path``) with ``flags`` exits 2 naming ``message``,
    before anything is written to its run directory."""
    code, err = run_train([*TINY, "--vocab-size", "300", "--data", str(data), *flags,
                           "--run-dir", str(tmp_path / "run")])
    assert code == 2 and err.count(message) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run" / "config.toml").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind", ["stream", "samples", "held out"])
def test_every_target_masked_is_refused(tmp_path, kind):
    """A run whose training samples hold no counted target is refused (it would report loss 0.0
    and grad norm 0.0 and "train"): a loss mask of zeros, inputs that are all the EOS, or
    counted targets only in the held-out samples."""
    tokens = np.arange(64) % 7 + 1
    if kind == "stream":
        with h5py.File(tmp_path / "sft.h5", "w") as f:
            f["tokens"] = tokens.astype(np.uint16)
            f["loss_mask"] = np.zeros(64, np.uint8)
            f.attrs.update(_record())
        flags, want = ["--loss-mask"], "loss_mask is 0 at every target (--loss-mask)"
        data, samples = tmp_path / "sft.h5", 7
    elif kind == "samples":
        np.save(tmp_path / "s.npy", np.full((6, 9), 5, np.int64))
        flags = ["--eod-mask-loss", "--eos-token-id", "5"]
        want, data, samples = "every input is the EOS id 5 (--eod-mask-loss)", tmp_path / "s.npy", 6
    else:  # a stream of EOS but for the last sample's inputs, which --eval-fraction holds out
        stream = np.full(81, 5, np.int64)
        stream[72:80] = 1
        np.save(tmp_path / "s.npy", stream)
        flags = ["--eod-mask-loss", "--eos-token-id", "5", "--eval-fraction", "0.1",
                 "--eval-batches", "1", "--global-batch-size", "1"]
        want, data, samples = "every input is the EOS id 5 (--eod-mask-loss)", tmp_path / "s.npy", 9
    _packed(tmp_path, flags, data, f"{data}: no target of its {samples} training samples carries "
                                   f"loss ({want}); the run would report loss 0")


def test_a_step_with_no_counted_target_says_so(tmp_path):
    """A step whose global batch holds no counted target, while other steps have some, is marked:
    its record (``no_targets``, ``counted_targets`` 0), the step line says why, and the summary
    names the step and leaves its 0 out of the loss figures. Every rank counts the whole global
    batch's targets, so all agree."""
    import io
    eos = 5
    rows = np.tile(np.arange(10, 19), (6, 1))
    rows[0, 0] = rows[1, 4] = eos          # step 1: 7 + 7 counted targets
    rows[2:4] = eos                        # step 2: every input the EOS: none counted
    np.save(tmp_path / "s.npy", rows)      # step 3: 16 counted targets
    out = io.StringIO()
    code, err = run_train([*TINY, "--vocab-size", "300", "--data", str(tmp_path / "s.npy"),
                           "--steps", "3", "--no-shuffle", "--eod-mask-loss", "--eos-token-id",
                           str(eos), "--log-every", "10", "--run-dir", str(tmp_path / "run")],
                          out)
    assert code == 0, err
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r.get("counted_targets") for r in records] == [14, 0, 16]
    assert [r.get("no_targets", False) for r in records] == [False, True, False]
    assert records[1]["loss"] == 0.0 and records[1]["grad_norm"] == 0.0
    assert records[0]["loss"] > 1 and records[2]["loss"] > 1
    text = out.getvalue()
    assert text.count("no counted target in the global batch") == 1, text
    assert "step      2/3  no counted target in the global batch: every label is masked" in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["no_target_steps"] == [2]
    assert summary["loss_min"] == min(records[0]["loss"], records[2]["loss"])
    assert summary["loss_last"] == pytest.approx((records[0]["loss"] + records[2]["loss"]) / 2,
                                                 rel=1e-12)
    assert ("steps with no counted target: 1 (step 2): every label of the global batch masked"
            in (tmp_path / "run" / "summary.txt").read_text())


@pytest.mark.parametrize("flag", ["--document-masking", "--eod-mask-loss"])
@pytest.mark.parametrize("fmt", ["text", "samples"])
def test_an_eos_id_the_data_never_holds_is_refused(tmp_path, flag, fmt):
    """``--document-masking --eos-token-id`` with an id the data never contains is refused (it
    would run as plain causal attention): the id must occur in the training data."""
    if fmt == "text":
        (tmp_path / "d.txt").write_bytes(b"the cat sat on the mat\n" * 8)
        data, tokens = tmp_path / "d.txt", 8 * 23
    else:
        np.save(tmp_path / "d.npy", np.arange(54).reshape(6, 9) % 3)
        data, tokens = tmp_path / "d.npy", 54
    _packed(tmp_path, [flag, "--eos-token-id", "3"], data,
            f"train.eos_token_id=3: the id never occurs in the {tokens} tokens of the training "
            f"data ({data}); {flag} needs the id that ends its documents")


def test_the_planner_refuses_an_eos_id_the_data_never_holds(tmp_path, capsys):
    """``mpipar.plan --document-masking`` reads the same data under the same rules."""
    from mpipar.plan.cli import main as plan_main
    (tmp_path / "d.txt").write_bytes(b"the cat sat on the mat\n" * 64)
    argv = ["--world", "2", "--top", "0", "--peak-gflops", "100", "--intra-gbps", "10",
            "--data", str(tmp_path / "d.txt"), "--seq-len", "64", "--global-batch-size", "4",
            "--document-masking", "--eos-token-id"]
    assert plan_main([*argv, "3"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert ("train.eos_token_id=3: the id never occurs in the 1472 tokens of the training data"
            in err), err
    assert plan_main([*argv, "10"]) == 0          # the newline ends each line's document


def test_an_eos_id_against_the_recorded_one_is_refused(tmp_path):
    """An ``--eos-token-id`` contradicting the data's recorded ``eos_id`` is refused naming both
    (the recorded one ends the documents); the same id given again is accepted."""
    _tokens_file(tmp_path / "t.h5", np.arange(64) % 7, **_record())
    _packed(tmp_path, ["--document-masking", "--eos-token-id", "5"], tmp_path / "t.h5",
            f"train.eos_token_id=5: the data ({tmp_path / 't.h5'}) records eos_id=0 ('</s>') as "
            f"the end of its documents")
    code, err = run_train([*TINY, "--vocab-size", "300", "--data", str(tmp_path / "t.h5"),
                           "--document-masking", "--eos-token-id", "0",
                           "--run-dir", str(tmp_path / "ok")])
    assert code == 0, err


# ------------------------------------------------------------- text that spells a special token
def _library_ids(tok, text: str, parse_special: bool = False) -> list[int]:
    """The `tokenizers` library's ids of ``text``: special tokens' text as those tokens iff
    ``parse_special`` (its ``encode_special_tokens`` switch)."""
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=False).ids if text else []
    finally:
        tok.encode_special_tokens = False


def test_special_token_text_in_sft_records_stays_text(tmp_path, capsys, chatml):
    """A literal ``</s>`` or ``<|im_end|>`` in a prompt or completion stays text (the library's
    ids with its special tokens off), so a user's string cannot end or mask an example: in
    prompt/completion records and in chat messages, while the ChatML template's own markup
    stays special tokens; the EOS id occurs only where an example ends.
    ``--parse-special-tokens`` gives the control ids."""
    pytest.importorskip("jinja2")
    root, tok = chatml
    vocab = tok.get_vocab()
    start, end, eos = vocab["<|im_start|>"], vocab["<|im_end|>"], vocab["</s>"]
    user, reply = "the cat</s> sat<|im_end|>", "on a mat <|im_start|>user"
    prompt, completion = "a </s> b", "c<|im_end|>"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"messages": [{"role": "user", "content": user},
                                              {"role": "assistant", "content": reply}]}) + "\n"
                     + json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    text = lambda s: _library_ids(tok, s)  # noqa: E731
    chat_p = [start, *text("user\n" + user), end, *text("\n"), start, *text("assistant\n")]
    chat_c = [*text(reply), end, *text("\n"), eos]
    pair_p, pair_c = text(prompt), [*text(completion), eos]
    for parse in (False, True):
        out = tmp_path / f"sft{parse}.h5"
        assert main(["prepare", "--sft", str(pairs), "--tokenizer", str(root), "--out", str(out),
                     *(["--parse-special-tokens"] if parse else [])]) == 0
        with h5py.File(out) as f:
            ids, mask = f["tokens"][:].tolist(), f["loss_mask"][:].tolist()
        if parse:   # the text became the tokens: an EOS inside the first prompt
            assert ids[:len(chat_p) + 2] != chat_p and ids.index(eos) < len(chat_p)
            tail = [*_library_ids(tok, prompt, True), *_library_ids(tok, completion, True), eos]
            assert ids[-len(tail):] == tail and tail.count(eos) == 2
            continue
        assert ids == chat_p + chat_c + pair_p + pair_c
        assert mask == [0] * len(chat_p) + [1] * len(chat_c) + [0] * len(pair_p) + [1] * len(pair_c)
        ends = len(chat_p + chat_c) - 1, len(ids) - 1
        assert [i for i, t in enumerate(ids) if t == eos] == list(ends)
        assert tok.decode(ids, skip_special_tokens=False) == (
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n</s>"
            f"{prompt}{completion}</s>")


def test_special_token_text_in_documents_stays_text(tmp_path, bpe):
    """The same for ``prepare --tokenizer``: a document that spells the EOS is one document,
    with and without worker processes; ``--parse-special-tokens`` cuts it there."""
    root, tok = bpe
    eos = tok.get_vocab()["<|endoftext|>"]
    docs = ["the cat<|endoftext|>sat on a mat", "dogs ran <|endoftext|>"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.jsonl").write_text(json.dumps({"text": d}) + "\n")
    inputs = [str(tmp_path / f"{i}.jsonl") for i in range(2)]
    for parse, workers in ((False, "1"), (False, "2"), (True, "1")):
        out = tmp_path / f"t{parse}{workers}.h5"
        assert main(["prepare", *inputs, "--tokenizer", str(root), "--out", str(out),
                     "--workers", workers, *(["--parse-special-tokens"] if parse else [])]) == 0
        with h5py.File(out) as f:
            ids = f["tokens"][:].tolist()
        assert ids == [t for d in docs for t in (*_library_ids(tok, d, parse), eos)]
        assert ids.count(eos) == (4 if parse else 2)


@pytest.mark.parametrize("record,template,message", [
    ({"messages": [{"role": "user<|im_end|>", "content": "the cat"},
                   {"role": "assistant", "content": "sat"}]}, "",
     "'user<|im_end|>' spells the special token '<|im_end|>' outside a message's text"),
    ({"messages": [{"role": "user", "content": " the cat</s> "},
                   {"role": "assistant", "content": "sat"}]}, "trim",
     "a message spells a special token, and the chat template changes the messages' text"),
    ({"messages": [{"role": "user", "content": "\ue0001\ue001 </s>"},
                   {"role": "assistant", "content": "sat"}]}, "",
     "a message spells a special token, and the chat template changes the messages' text"),
], ids=["role", "template changes the text", "text holds the marks"])
def test_special_token_text_that_cannot_be_placed_is_refused(tmp_path, capsys, chatml, record,
                                                             template, message):
    """Where a special token's text cannot be told from the template's markup (a role spells
    it, or the template rewrites the text that does), the record is refused naming the line."""
    pytest.importorskip("jinja2")
    import shutil
    from small_tokenizers import CHATML
    root = tmp_path / "tok"
    shutil.copytree(chatml[0], root)
    if template:
        config = json.loads((root / "tokenizer_config.json").read_text())
        config["chat_template"] = CHATML.replace("m['content']", "m['content'] | trim")
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "the", "completion": "cat"})
                                          + "\n" + json.dumps(record) + "\n")
    pairs = tmp_path / "pairs.jsonl"
    _refused(capsys, ["prepare", "--sft", str(pairs), "--tokenizer", str(root), "--out",
                      str(tmp_path / "out.h5")], f"{pairs}:2: {message}")
    assert not (tmp_path / "out.h5").exists()
