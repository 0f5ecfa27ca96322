"""Launched training runs on data prepared with a real BPE tokenizer (:mod:`small_tokenizers`):
4 ranks read them exactly as one does, and a model vocabulary that is too small is refused once."""
from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import MPIRUN, needs_mpirun
from mpipar.data.cli import main
from mpipar.data.tokenizer import prepare_tokenized
from small_tokenizers import bpe, corpus, random_documents  # noqa: F401  (fixtures)


def _train(ranks: int, args: list[str], run_dir) -> subprocess.CompletedProcess:
    launch = [MPIRUN, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *args, "--run-dir",
                           str(run_dir)], capture_output=True, text=True, timeout=240)


@needs_mpirun
def test_four_ranks_train_on_tokenized_data_as_one_does(tmp_path, bpe):
    root, tok = bpe
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(random_documents(300, 5)):
        (texts / f"{i // 50}.txt").open("a").write(doc + "\n")
    data = tmp_path / "tokens.h5"
    assert main(["prepare", str(texts), "--tokenizer", str(root), "--out", str(data)]) == 0
    vocab = tok.get_vocab_size()
    common = ["--data", str(data), "--vocab-size", str(vocab), "--hidden", "32", "--layers", "2",
              "--heads", "4", "--kv-heads", "2", "--seq-len", "32", "--global-batch-size", "4",
              "--steps", "6", "--warmup-steps", "0", "--lr", "1e-2", "--dtype", "float64",
              "--backend", "numpy", "--log-every", "0", "--tensorboard", "off"]
    runs = {}
    for ranks, layout in ((1, []), (4, ["--dp", "2", "--tp", "2"])):
        proc = _train(ranks, [*common, *layout], tmp_path / f"r{ranks}")
        assert proc.returncode == 0, proc.stderr
        assert not (tmp_path / f"r{ranks}" / "tensorboard").exists()  # --tensorboard off
        with open(tmp_path / f"r{ranks}" / "metrics.jsonl") as fh:
            runs[ranks] = [json.loads(line)["loss"] for line in fh]
    one, four = runs[1], runs[4]
    assert len(one) == len(four) == 6 and all(math.isfinite(x) for x in one + four)
    assert all(abs(a - b) <= 1e-10 * a for a, b in zip(one, four)), (one, four)
    # from a near-uniform start over the tokenizer's vocabulary, the loss falls
    assert abs(one[0] - math.log(vocab)) < 0.1 and one[-1] < one[0] - 0.3, one


@needs_mpirun
def test_a_model_vocabulary_smaller_than_the_tokenizer_exits_2_once(tmp_path, bpe, corpus):
    root, tok = bpe
    files, _ = corpus
    data = tmp_path / "tokens.h5"
    prepare_tokenized(files, data, root, workers=1)
    vocab = tok.get_vocab_size()
    proc = _train(4, ["--data", str(data), "--vocab-size", "256", "--hidden", "32", "--layers",
                      "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "16",
                      "--global-batch-size", "4", "--backend", "numpy"], tmp_path / "run")
    message = (f"the model's vocabulary has 256 (--vocab-size 256): ids 256..{vocab - 1} would "
               f"have no embedding; use --vocab-size {vocab}")
    assert proc.returncode == 2 and proc.stderr.count(message) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
