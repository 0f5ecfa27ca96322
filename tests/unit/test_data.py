"""Token sources (exact tokens per format), the sampler's contract, errors, and the built-in corpus."""

import h5py
import numpy as np
import pytest

from mpipar.data import sources as data
from mpipar.data.cli import main
from mpipar.data.sources import DataError, Sampler, load_tokens, stdlib_corpus


def windows(tokens, seq_len):
    """Reference stream sampling: window i = tokens[i*S : i*S + S + 1]."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = (len(tokens) - 1) // seq_len
    return np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


def all_samples(src):
    return src.sample(np.arange(src.num_samples))


# --------------------------------------------------------------------------- sources


def test_text_file(tmp_path):
    text = b"hello, world!\nthe quick brown fox\n"
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    src = load_tokens(str(path), vocab_size=256, seq_len=4)
    assert (src.kind, src.format, src.num_tokens) == ("stream", "text", len(text))
    assert src.num_samples == (len(text) - 1) // 4
    np.testing.assert_array_equal(all_samples(src), windows(list(text), 4))
    assert bytes(src.sample([0])[0].astype(np.uint8)) == b"hello"
    assert bytes(src.sample([1])[0].astype(np.uint8)) == b"o, wo"


def test_directory_sorted_recursive_skips_hidden(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"BBBB")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_bytes(b"zz")
    (tmp_path / "a" / "deeper").mkdir()
    (tmp_path / "a" / "deeper" / "x.md").write_bytes(b"xxx")
    (tmp_path / ".hidden").write_bytes(b"SECRET")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_bytes(b"GIT")
    (tmp_path / "a" / ".cache").write_bytes(b"CACHE")
    src = load_tokens(str(tmp_path), vocab_size=256, seq_len=2)
    expected = b"xxx" + b"zz" + b"BBBB"          # a/deeper/x.md < a/z.txt < b.txt
    assert (src.format, src.num_tokens) == ("directory", len(expected))
    np.testing.assert_array_equal(all_samples(src), windows(list(expected), 2))


def test_bin_uint16(tmp_path):
    tokens = np.array([0, 1, 65535, 50256, 7, 300, 12, 9, 40000], dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    src = load_tokens(str(path), vocab_size=65536, seq_len=3)
    assert (src.kind, src.format, src.dtype, src.num_samples) == ("stream", "bin", np.uint16, 2)
    out = all_samples(src)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [[0, 1, 65535, 50256], [50256, 7, 300, 12]])


def test_npy_stream(tmp_path):
    tokens = np.arange(100, 120, dtype=np.int32)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    src = load_tokens(str(path), vocab_size=1000, seq_len=5)
    assert (src.kind, src.num_tokens, src.num_samples) == ("stream", 20, 3)
    np.testing.assert_array_equal(src.sample([2, 0, 2]), [[110 + k for k in range(6)],
                                                          [100 + k for k in range(6)],
                                                          [110 + k for k in range(6)]])


def test_npy_samples(tmp_path):
    rows = np.arange(4 * 6, dtype=np.int64).reshape(4, 6)
    path = tmp_path / "samples.npy"
    np.save(path, rows)
    src = load_tokens(str(path), vocab_size=24, seq_len=5)
    assert (src.kind, src.num_samples, src.num_tokens) == ("samples", 4, 24)
    np.testing.assert_array_equal(src.sample([3, 1, 3]), rows[[3, 1, 3]])


def test_h5_tokens_and_samples(tmp_path):
    tokens = np.array([5, 4, 3, 2, 1, 0, 9, 8], dtype=np.uint32)
    rows = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.int16)
    with h5py.File(tmp_path / "stream.h5", "w") as f:
        f.create_dataset("tokens", data=tokens, chunks=(3,))
    with h5py.File(tmp_path / "rows.hdf5", "w") as f:
        f.create_dataset("samples", data=rows)
    stream = load_tokens(str(tmp_path / "stream.h5"), vocab_size=10, seq_len=3)
    assert (stream.kind, stream.format, stream.num_samples) == ("stream", "hdf5", 2)
    np.testing.assert_array_equal(all_samples(stream), [[5, 4, 3, 2], [2, 1, 0, 9]])
    samples = load_tokens(str(tmp_path / "rows.hdf5"), vocab_size=10, seq_len=2)
    assert (samples.kind, samples.num_samples) == ("samples", 3)
    np.testing.assert_array_equal(samples.sample([2, 0, 2, 1]), rows[[2, 0, 2, 1]])


def test_stdlib_source_and_path_aliases():
    a = load_tokens(None, vocab_size=256, seq_len=64)
    b = load_tokens("stdlib", vocab_size=256, seq_len=64)
    assert a.format == b.format == "stdlib"
    assert a.num_tokens == b.num_tokens == stdlib_corpus().size
    np.testing.assert_array_equal(a.sample([0, 5]), b.sample([0, 5]))
    np.testing.assert_array_equal(a.sample([1])[0], stdlib_corpus()[64:129])


def test_stdlib_corpus_deterministic_bytes():
    stdlib_corpus.cache_clear()
    first = stdlib_corpus()
    stdlib_corpus.cache_clear()
    second = stdlib_corpus()
    assert first is not second
    assert first.dtype == np.uint8 and first.ndim == 1
    assert 1_000_000 < first.size <= data.STDLIB_CAP_BYTES
    np.testing.assert_array_equal(first, second)
    assert b"def " in first.tobytes()
    assert not first.flags.writeable


def test_sample_index_out_of_range(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(10))
    src = load_tokens(str(path), vocab_size=10, seq_len=3)
    with pytest.raises(ValueError, match=r"sample index 3 is outside \[0, 3\)"):
        src.sample([0, 3])


# --------------------------------------------------------------------------- sampler


def _stream_source(tmp_path, num_samples, seq_len=2):
    path = tmp_path / "s.npy"
    np.save(path, np.arange(num_samples * seq_len + 1, dtype=np.int64))
    src = load_tokens(str(path), vocab_size=num_samples * seq_len + 1, seq_len=seq_len)
    assert src.num_samples == num_samples
    return src


def test_no_shuffle_steps_take_consecutive_samples_and_wrap(tmp_path):
    src = _stream_source(tmp_path, 10)
    s = Sampler(src, global_batch=4, seed=123, shuffle=False)
    np.testing.assert_array_equal(s.indices(0), [0, 1, 2, 3])
    np.testing.assert_array_equal(s.indices(1), [4, 5, 6, 7])
    np.testing.assert_array_equal(s.indices(2), [8, 9, 0, 1])
    np.testing.assert_array_equal(s.indices(7), [8, 9, 0, 1])   # positions 28..31
    inputs, targets = s.batch(1)
    np.testing.assert_array_equal(inputs, [[8, 9], [10, 11], [12, 13], [14, 15]])
    np.testing.assert_array_equal(targets, [[9, 10], [11, 12], [13, 14], [15, 16]])


def test_batch_rows_slice_and_shapes(tmp_path):
    src = _stream_source(tmp_path, 12, seq_len=3)
    s = Sampler(src, global_batch=6, seed=5)
    full_in, full_tg = s.batch(4)
    assert full_in.shape == full_tg.shape == (6, 3)
    assert full_in.dtype == full_tg.dtype == np.int64
    np.testing.assert_array_equal(full_in[:, 1:], full_tg[:, :-1])
    parts = [s.batch(4, slice(r * 2, (r + 1) * 2)) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), full_in)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), full_tg)
    rows = src.sample(s.indices(4))
    np.testing.assert_array_equal(full_in, rows[:, :-1])


@pytest.mark.parametrize("num_samples, batch", [(12, 4), (10, 4), (3, 7)])
def test_shuffle_visits_every_sample_once_per_epoch(tmp_path, num_samples, batch):
    src = _stream_source(tmp_path, num_samples)
    s = Sampler(src, global_batch=batch, seed=42)
    epochs = 3
    steps = -(-epochs * num_samples // batch)
    order = np.concatenate([s.indices(k) for k in range(steps)])
    for e in range(epochs):
        epoch = order[e * num_samples:(e + 1) * num_samples]
        np.testing.assert_array_equal(np.sort(epoch), np.arange(num_samples))
        np.testing.assert_array_equal(
            epoch, np.random.default_rng([42, e]).permutation(num_samples))


def test_shuffle_deterministic_and_stateless(tmp_path):
    src = _stream_source(tmp_path, 50)
    a = Sampler(src, global_batch=8, seed=7)
    b = Sampler(src, global_batch=8, seed=7)
    forward = [a.indices(k) for k in range(20)]
    backward = [b.indices(k) for k in reversed(range(20))][::-1]   # any call order, same answer
    for x, y in zip(forward, backward):
        np.testing.assert_array_equal(x, y)
    resumed = Sampler(src, global_batch=8, seed=7)
    np.testing.assert_array_equal(resumed.indices(13), forward[13])
    other = Sampler(src, global_batch=8, seed=8)
    assert not all(np.array_equal(other.indices(k), forward[k]) for k in range(7))
    assert not np.array_equal(forward[0], np.arange(8))


@pytest.mark.parametrize("kwargs, pattern", [
    ({"global_batch": 0, "seed": 0}, r"global_batch must be an integer >= 1, got 0"),
    ({"global_batch": 2, "seed": -1}, r"seed must be an integer >= 0, got -1"),
])
def test_sampler_validation(tmp_path, kwargs, pattern):
    src = _stream_source(tmp_path, 4)
    with pytest.raises(ValueError, match=pattern):
        Sampler(src, **kwargs)
    with pytest.raises(ValueError, match=r"step must be an integer >= 0, got -1"):
        Sampler(src, 2, 0).indices(-1)


# --------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(DataError, match=rf"{missing} does not exist"):
        load_tokens(str(missing), 256, 8)


@pytest.mark.parametrize("name", ["empty.txt", "empty.bin"])
def test_empty_file(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(DataError, match=rf"{name}: the token source is empty"):
        load_tokens(str(tmp_path / name), 65536, 8)


def test_empty_directory_and_empty_npy(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".only_hidden").write_bytes(b"abc")
    with pytest.raises(DataError, match=r"d: the token source is empty"):
        load_tokens(str(tmp_path / "d"), 256, 8)
    np.save(tmp_path / "e.npy", np.zeros((0, 9), np.int32))
    with pytest.raises(DataError, match=r"e.npy: the token source is empty \(shape \(0, 9\)\)"):
        load_tokens(str(tmp_path / "e.npy"), 256, 8)


def test_stream_too_short(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"abcdefgh")
    with pytest.raises(DataError, match=r"short.txt: the stream has 8 tokens, fewer than the "
                                        r"seq_len \+ 1 = 9 .*--seq-len 8"):
        load_tokens(str(tmp_path / "short.txt"), 256, 8)
    assert load_tokens(str(tmp_path / "short.txt"), 256, 7).num_samples == 1


def test_non_integer_dtype(tmp_path):
    np.save(tmp_path / "f.npy", np.ones(20, np.float32))
    with pytest.raises(DataError, match=r"f.npy: tokens must have an integer dtype, got float32"):
        load_tokens(str(tmp_path / "f.npy"), 256, 4)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("tokens", data=np.ones(20))
    with pytest.raises(DataError, match=r"f.h5: tokens must have an integer dtype, got float64"):
        load_tokens(str(tmp_path / "f.h5"), 256, 4)


def test_wrong_row_length(tmp_path):
    np.save(tmp_path / "rows.npy", np.zeros((3, 9), np.int32))
    with pytest.raises(DataError, match=r"rows.npy: rows hold 9 tokens, but --seq-len 16 needs rows "
                                        r"of seq_len \+ 1 = 17"):
        load_tokens(str(tmp_path / "rows.npy"), 256, 16)


def test_bad_ndim(tmp_path):
    np.save(tmp_path / "cube.npy", np.zeros((2, 3, 4), np.int32))
    with pytest.raises(DataError, match=r"cube.npy: tokens must be 1-D .* got shape \(2, 3, 4\)"):
        load_tokens(str(tmp_path / "cube.npy"), 256, 3)


def test_token_above_vocab_found_in_later_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHECK_CHUNK", 4)
    tokens = np.arange(30, dtype=np.uint16) % 50
    tokens[17] = 50
    tokens.tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match=r"big.bin: token id 50 at position 17 is outside the "
                                        r"vocabulary \[0, 50\) \(--vocab-size 50\)"):
        load_tokens(str(tmp_path / "big.bin"), 50, 4)
    assert load_tokens(str(tmp_path / "big.bin"), 51, 4).num_samples == 7


def test_negative_token_and_samples_position(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHECK_CHUNK", 5)
    np.save(tmp_path / "neg.npy", np.array([3, 2, -4, 1, 0], np.int64))
    with pytest.raises(DataError, match=r"neg.npy: token id -4 at position 2 is outside"):
        load_tokens(str(tmp_path / "neg.npy"), 10, 2)
    rows = np.zeros((6, 4), np.int32)
    rows[4, 2] = 99
    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f.create_dataset("samples", data=rows)
    with pytest.raises(DataError, match=r"rows.h5: token id 99 at row 4, column 2 is outside the "
                                        r"vocabulary \[0, 99\)"):
        load_tokens(str(tmp_path / "rows.h5"), 99, 3)


def test_text_needs_byte_vocabulary(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"plain ascii text")
    with pytest.raises(DataError, match=r"t.txt: byte-level text .* needs --vocab-size >= 256 \(got 128\)"):
        load_tokens(str(tmp_path / "t.txt"), 128, 4)
    with pytest.raises(DataError, match=r"stdlib: byte-level text .* \(got 100\)"):
        load_tokens("stdlib", 100, 4)


def test_odd_bin_size_and_unreadable_formats(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd.bin: size 3 bytes is not a multiple of 2"):
        load_tokens(str(tmp_path / "odd.bin"), 256, 1)
    (tmp_path / "bad.npy").write_bytes(b"not a numpy file at all")
    with pytest.raises(DataError, match=r"cannot read .*bad.npy as a .npy array"):
        load_tokens(str(tmp_path / "bad.npy"), 256, 1)
    (tmp_path / "bad.h5").write_bytes(b"not hdf5 either")
    with pytest.raises(DataError, match=r"cannot read .*bad.h5 as HDF5"):
        load_tokens(str(tmp_path / "bad.h5"), 256, 1)


def test_h5_dataset_rules(tmp_path):
    with h5py.File(tmp_path / "none.h5", "w") as f:
        f.create_dataset("ids", data=np.arange(10))
    with pytest.raises(DataError, match=r"none.h5: needs a dataset 'tokens' .* top-level names: \['ids'\]"):
        load_tokens(str(tmp_path / "none.h5"), 256, 2)
    with h5py.File(tmp_path / "both.h5", "w") as f:
        f.create_dataset("tokens", data=np.arange(10))
        f.create_dataset("samples", data=np.zeros((2, 3), np.int32))
    with pytest.raises(DataError, match=r"both.h5: has both datasets"):
        load_tokens(str(tmp_path / "both.h5"), 256, 2)
    with h5py.File(tmp_path / "flat.h5", "w") as f:
        f.create_dataset("samples", data=np.arange(10))
    with pytest.raises(DataError, match=r"flat.h5: dataset 'samples' must be 2-D, got shape \(10,\)"):
        load_tokens(str(tmp_path / "flat.h5"), 256, 2)


@pytest.mark.parametrize("vocab, seq, pattern", [
    (0, 4, r"vocab_size must be an integer >= 1, got 0"),
    (256, 0, r"seq_len must be an integer >= 1, got 0"),
])
def test_bad_sizes(tmp_path, vocab, seq, pattern):
    with pytest.raises(DataError, match=pattern):
        load_tokens("stdlib", vocab, seq)


# --------------------------------------------------------------------------- command line


def test_info_command(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.arange(101, dtype=np.int32))
    assert main(["info", str(tmp_path / "t.npy"), "--seq-len", "10", "--vocab-size", "200"]) == 0
    out = capsys.readouterr().out
    assert "format:   npy" in out and "kind:     stream" in out
    assert "tokens:   101" in out and "samples:  10" in out
    assert main(["info", str(tmp_path / "t.npy"), "--seq-len", "10", "--vocab-size", "100"]) == 2
    err = capsys.readouterr().err
    assert "token id 100 at position 100" in err
