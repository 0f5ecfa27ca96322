"""`python -m mpipar.data prepare INPUT... --tokenizer T --out tokens.h5` in process, with a real BPE
tokenizer trained here by the `tokenizers` library (:mod:`small_tokenizers`): the stored ids are
the tokenizer's encoding of every document followed by EOS, in the smallest dtype, with the
tokenizer recorded. Training on them: e2e/test_tokenizer.py."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import h5py
import numpy as np
import pytest

from mpipar.data import documents
from mpipar.data.cli import main
from mpipar.data.sources import DataError, load_tokens
from mpipar.data.tokenizer import load_tokenizer, prepare_tokenized, token_dtype
from small_tokenizers import EOS, bpe, corpus, random_documents  # noqa: F401  (fixtures)


def _ids(tok, texts: list[str]) -> list[int]:
    """The reference: each document's encoding, then EOS."""
    eos = tok.token_to_id(EOS)
    return [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids + [eos]]


def test_prepared_ids_are_the_encoding_of_every_document_then_eos(tmp_path, bpe, corpus):
    root, tok = bpe
    files, docs = corpus
    out = tmp_path / "tokens.h5"
    done = prepare_tokenized([os.path.dirname(files[0])], out, root, workers=1)
    want = [np.array(_ids(tok, d)) for d in docs]
    vocab = tok.get_vocab_size()
    assert 256 < vocab <= 400
    with h5py.File(out, "r") as f:
        tokens = f["tokens"]
        assert tokens.dtype == np.uint16 and tokens.fletcher32 and tokens.maxshape == (None,)
        assert np.array_equal(tokens[...], np.concatenate(want))
        attrs = dict(f.attrs)
    assert list(attrs["files"]) == files and attrs["text_field"] == "text"
    assert attrs["offsets"].tolist() == np.cumsum([0] + [w.size for w in want]).tolist()
    assert attrs["documents"] == done.documents == sum(map(len, docs))
    assert attrs["tokenizer"] == str(root) and attrs["tokenizer_vocab_size"] == vocab
    sha = hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest()
    assert attrs["tokenizer_sha256"] == sha
    assert (attrs["eos_token"], attrs["eos_id"]) == (EOS, tok.token_to_id(EOS))
    assert done.tokens == sum(w.size for w in want)
    assert not (tmp_path / "tokens.h5.tmp").exists()

    src = load_tokens(out, vocab, 16)  # the training loader: samples are windows of the stream
    flat = np.concatenate(want)
    assert src.tokenizer["tokenizer_sha256"] == sha
    rows = src.sample(np.arange(src.num_samples))
    assert all(np.array_equal(r, flat[16 * i:16 * i + 17]) for i, r in enumerate(rows))
    assert load_tokens(out, vocab + 64, 16).num_tokens == flat.size  # a padded embedding table
    with pytest.raises(DataError, match=f"ids {vocab - 1}..{vocab - 1} would have no embedding; "
                                        f"use --vocab-size {vocab}"):
        load_tokens(out, vocab - 1, 16)


def test_worker_processes_write_the_same_file(tmp_path, bpe, corpus):
    root, _ = bpe
    files, _ = corpus
    one, two = tmp_path / "one.h5", tmp_path / "two.h5"
    prepare_tokenized(files, one, root / "tokenizer.json", workers=1)
    prepare_tokenized(files, two, root / "tokenizer.json", workers=2, chunk_tokens=100)
    with h5py.File(one, "r") as a, h5py.File(two, "r") as b:
        assert np.array_equal(a["tokens"][...], b["tokens"][...])
        assert a["tokens"].dtype == b["tokens"].dtype
        assert {k: str(v) for k, v in a.attrs.items()} == {k: str(v) for k, v in b.attrs.items()}
    assert not [p for p in os.listdir(tmp_path) if ".parts." in p]


def test_many_files_are_recorded(tmp_path, bpe):
    """The names of 500 files (over 64 KiB, more than a classic HDF5 attribute holds)."""
    root, tok = bpe
    texts = tmp_path / ("a_rather_long_directory_name_" * 4)
    texts.mkdir()
    for i in range(500):
        (texts / f"{i:05d}.txt").write_text(f"doc {i}")
    out = tmp_path / "many.h5"
    done = prepare_tokenized([texts], out, root, workers=1)
    assert done.documents == 500
    with h5py.File(out, "r") as f:
        assert sum(map(len, f.attrs["files"])) > 2**16 and len(f.attrs["offsets"]) == 501
        assert f.attrs["files"][-1] == str(texts / "00499.txt")
        assert f["tokens"][f.attrs["offsets"][-2]:].tolist() == _ids(tok, ["doc 499"])


def test_a_large_text_file_encoded_in_blocks_equals_the_whole(tmp_path, bpe):
    _, tok = bpe
    text = "\n".join(random_documents(80, 2)) + "\n  \n\u2603 end"
    path = tmp_path / "big.txt"
    path.write_text(text)
    batches = list(documents.read_batches(str(path), "text", batch_bytes=64))
    assert len(batches) > 10 and [b.ends for b in batches[:-1]] == [[False]] * (len(batches) - 1)
    assert batches[-1].ends == [True] and "".join(b.texts[0] for b in batches) == text
    assert sum(b.nbytes for b in batches) == len(text.encode())
    blocks = [i for b in batches for i in tok.encode(b.texts[0], add_special_tokens=False).ids]
    assert blocks == tok.encode(text, add_special_tokens=False).ids


def test_jsonl_text_field_and_its_errors(tmp_path, bpe, capsys):
    root, tok = bpe
    docs = random_documents(5, 3)
    good = tmp_path / "g.jsonl"
    good.write_text("".join(json.dumps({"body": d, "text": 7}) + "\n" for d in docs))
    out = tmp_path / "j.h5"
    assert main(["prepare", str(good), "--tokenizer", str(root), "--text-field", "body",
                 "--out", str(out), "--workers", "1"]) == 0
    assert f"in {len(docs)} document(s)" in capsys.readouterr().out
    with h5py.File(out, "r") as f:
        assert f["tokens"][...].tolist() == _ids(tok, docs)
    bad = tmp_path / "b.jsonl"
    for line, message in ((json.dumps({"text": "x"}), "line 2 has no field 'body'"),
                          (json.dumps({"body": ["x"]}), "line 2: field 'body' must be a string"),
                          ("{not json", "line 2 is not valid JSON")):
        bad.write_text(json.dumps({"body": "fine"}) + "\n" + line + "\n")
        assert main(["prepare", str(bad), "--tokenizer", str(root), "--text-field", "body",
                     "--out", str(tmp_path / "x.h5")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "x.h5").exists() and not (tmp_path / "x.h5.tmp").exists()
    # the text field (in a worker process too) is named with the file in the error
    assert main(["prepare", str(good), str(good), "--tokenizer", str(root),
                 "--out", str(tmp_path / "x.h5"), "--workers", "2"]) == 2
    assert "g.jsonl: line 1: field 'text' must be a string" in capsys.readouterr().err


def test_a_worker_error_among_many_files_ends_the_pool(tmp_path, bpe, capsys):
    """A DataError in the first of many files under --workers 2 ends the run with the error and
    no part files left: the pool is shut down with the files not started cancelled (the
    multiprocessing.Pool this replaced hung once in ~10 CI runs, waiting on its task thread)."""
    root, _ = bpe
    good = json.dumps({"text": "a fine document"}) + "\n"
    files = [tmp_path / f"{i:02d}.jsonl" for i in range(16)]
    for i, path in enumerate(files):
        path.write_text((good + "{not json\n") if i == 0 else good * 50)
    for attempt in range(3):
        out = tmp_path / f"x{attempt}.h5"
        assert main(["prepare", *map(str, files), "--tokenizer", str(root),
                     "--out", str(out), "--workers", "2"]) == 2
        assert "00.jsonl: line 2 is not valid JSON" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)


def test_parquet_rows_are_documents(tmp_path, bpe):
    pa = pytest.importorskip("pyarrow", reason="Parquet input needs pyarrow "
                                               "(pip install 'mpipar[parquet]')")
    import pyarrow.parquet as pq
    root, tok = bpe
    docs = random_documents(30, 4)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(30)), "content": docs}), path, row_group_size=7)
    out = tmp_path / "p.h5"
    done = prepare_tokenized([path], out, root, text_field="content", workers=1)
    with h5py.File(out, "r") as f:
        assert f["tokens"][...].tolist() == _ids(tok, docs)
    assert done.documents == 30
    with pytest.raises(DataError, match="no column 'text' .*columns: id, content"):
        prepare_tokenized([path], out, root)
    with pytest.raises(DataError, match="column 'id' has type int64"):
        prepare_tokenized([path], out, root, text_field="id")
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="row 1 of column 'text' is null"):
        prepare_tokenized([tmp_path / "n.parquet"], out, root)


def test_missing_packages_are_named(tmp_path, bpe, monkeypatch):
    root, _ = bpe
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"d.parquet: reading Parquet needs pyarrow: "
                                        r"pip install 'mpipar\[parquet\]'"):
        prepare_tokenized([tmp_path / "d.parquet"], tmp_path / "o.h5", root)
    (tmp_path / "t.txt").write_text("text")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match=r"needs the tokenizers package: "
                                        r"pip install 'mpipar\[tokenizers\]'"):
        prepare_tokenized([tmp_path / "t.txt"], tmp_path / "o.h5", root)


def test_eos_comes_from_the_config_the_special_tokens_or_eos(tmp_path, bpe):
    root, tok = bpe
    bare = tmp_path / "tokenizer.json"  # no tokenizer_config.json beside it
    bare.write_bytes((root / "tokenizer.json").read_bytes())
    assert load_tokenizer(bare)[1].eos_token == EOS  # the one known EOS among special tokens
    spec = load_tokenizer(bare, eos="cat")[1]
    assert (spec.eos_token, spec.eos_id) == ("cat", tok.token_to_id("cat"))
    with pytest.raises(DataError, match="'<nope>' is not in its vocabulary"):
        load_tokenizer(bare, eos="<nope>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    with pytest.raises(DataError, match="'</s>' is not in its vocabulary; name one with --eos"):
        load_tokenizer(bare)
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path / "..")


@pytest.mark.parametrize("vocab,dtype", [(2, np.uint8), (256, np.uint8), (257, np.uint16),
                                         (65536, np.uint16), (65537, np.uint32),
                                         (128256, np.uint32)])
def test_token_dtype_is_the_smallest_that_holds_the_vocabulary(vocab, dtype):
    assert token_dtype(vocab) == dtype


def test_info_shows_the_tokenizer_and_bytes_stay_the_default(tmp_path, bpe, corpus, capsys):
    root, tok = bpe
    files, _ = corpus
    out = tmp_path / "t.h5"
    prepare_tokenized(files, out, root, workers=1)
    assert main(["info", str(out), "--seq-len", "8"]) == 0  # the vocabulary from the file
    text = capsys.readouterr().out
    assert f"vocab:    {tok.get_vocab_size()}" in text and "dtype:    uint16" in text
    assert f"  name:       {root}" in text and f"'{EOS}' = {tok.token_to_id(EOS)}" in text
    assert main(["prepare", files[0], "--out", str(tmp_path / "b.h5")]) == 0  # bytes, as before
    assert "byte tokens (vocabulary 256)" in capsys.readouterr().out
    assert main(["prepare", files[0], "--out", str(tmp_path / "c.h5"), "--text-field", "x"]) == 2
    assert "--text-field needs --tokenizer" in capsys.readouterr().err
