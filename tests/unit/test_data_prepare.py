"""`python -m mpipar.data prepare TEXT... --out tokens.h5`, in process: the bytes of the files, in
order, as a chunked, checksummed 1-D `tokens` dataset that the HDF5 loader reads back sample for
sample; bad input and outputs refused. The launched program: e2e/test_data_prepare.py."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from mpipar.data.cli import main
from mpipar.data.prepare import prepare_tokens
from mpipar.data.sources import DataError, load_tokens
from text_files import write_texts


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_prepare_writes_the_concatenated_bytes(tmp_path, chunk):
    rng = np.random.default_rng(0)
    contents = [b"hello world\n", bytes(rng.integers(0, 256, 100, dtype=np.uint8)), b"",
                "caf\u00e9 \u2603\n".encode()]
    paths = write_texts(tmp_path, contents)
    out = tmp_path / "tokens.h5"
    assert prepare_tokens(paths, out, chunk_tokens=chunk) == sum(map(len, contents))
    want = np.frombuffer(b"".join(contents), dtype=np.uint8)
    with h5py.File(out, "r") as f:
        d = f["tokens"]
        assert d.dtype == np.uint8 and d.shape == want.shape and d.ndim == 1
        assert d.fletcher32 and d.chunks == (min(chunk, want.size),)
        assert np.array_equal(d[...], want)
        assert list(f.attrs["files"]) == paths
        assert f.attrs["offsets"].tolist() == np.cumsum([0] + list(map(len, contents))).tolist()
    assert not (tmp_path / "tokens.h5.tmp").exists()

    src = load_tokens(out, 256, 8)  # the training loader reads it as a byte stream
    assert (src.format, src.kind, src.num_tokens) == ("hdf5", "stream", want.size)
    rows = src.sample(np.arange(src.num_samples))  # sample i: tokens [8 i, 8 i + 9)
    for i, row in enumerate(rows):
        assert np.array_equal(row, want[8 * i:8 * i + 9])


def test_prepare_command_line(tmp_path, capsys):
    paths = write_texts(tmp_path, [b"abc" * 10, b"xyz" * 5])
    out = tmp_path / "t.hdf5"
    assert main(["prepare", *paths, "--out", str(out)]) == 0
    assert "45 byte tokens" in capsys.readouterr().out
    with h5py.File(out, "r") as f:
        assert bytes(f["tokens"][...]) == b"abc" * 10 + b"xyz" * 5


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"), ("directory", "is a directory"),
    ("suffix", "must end in .h5"), ("empty", "hold no bytes")])
def test_prepare_rejects_bad_input(tmp_path, capsys, case, message):
    good = write_texts(tmp_path, [b"some text"])
    out = str(tmp_path / "o.h5")
    (tmp_path / "no_files" / ".hidden").mkdir(parents=True)
    args = {"missing": [str(tmp_path / "nope.txt")], "directory": [str(tmp_path / "no_files")],
            "suffix": good, "empty": write_texts(tmp_path, [b"", b""], "e")}[case]
    if case == "suffix":
        out = str(tmp_path / "o.bin")
    with pytest.raises(DataError, match=message):
        prepare_tokens(args, out)    # files only: the command line expands directories
    assert main(["prepare", *args, "--out", out]) == 2
    assert ("the directory holds no regular, non-hidden file" if case == "directory"
            else message) in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


def test_prepare_creates_a_missing_output_directory_and_names_an_unwritable_one(tmp_path,
                                                                                capsys):
    """``data prepare --out missing_dir/x.h5`` was a traceback. The directory
    is now created (as a run creates its output directories); one that cannot be created is an
    error naming the output, status 2."""
    paths = write_texts(tmp_path, [b"abc" * 10])
    out = tmp_path / "missing_dir" / "x.h5"
    assert main(["prepare", *paths, "--out", str(out)]) == 0
    assert load_tokens(out, 256, 4).num_tokens == 30
    (tmp_path / "a_file").write_bytes(b"")
    blocked = tmp_path / "a_file" / "x.h5"
    capsys.readouterr()
    assert main(["prepare", *paths, "--out", str(blocked)]) == 2
    err = capsys.readouterr().err
    assert f"--out {blocked}: cannot be written" in err and "Traceback" not in err, err


def test_prepare_reads_a_directory_as_data_dir_does(tmp_path, capsys):
    """``data prepare DIR`` accepts a directory as ``--data DIR`` and ``prepare DIR
    --tokenizer`` do: its files (recursive, sorted, hidden ones skipped) are prepared as
    ``--data DIR`` reads them, the same bytes in the same order."""
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"second file\n")
    (root / "a.txt").write_bytes(b"first file\n")
    (root / "sub" / "c.txt").write_bytes(b"nested\n")
    (root / ".hidden").write_bytes(b"never read\n")
    out = tmp_path / "dir.h5"
    assert main(["prepare", str(root), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote {out}: 30 byte tokens (vocabulary 256) "
                                                f"from 3 file(s)")
    with h5py.File(out, "r") as f:
        got = f["tokens"][...]
        assert list(f.attrs["files"]) == [str(root / n) for n in ("a.txt", "b.txt", "sub/c.txt")]
    assert got.tobytes() == b"first file\nsecond file\nnested\n"
    direct = load_tokens(root, 256, 8)
    assert np.array_equal(direct.sample(np.arange(3)),
                          load_tokens(out, 256, 8).sample(np.arange(3)))
