"""Small tokenizers made here with the `tokenizers` library, and the text they are made from:
a byte-level BPE tokenizer of about 400 tokens trained on random documents of a few words, a
word-level one of seven words. Shared by the tokenizer, generation and token data tests."""
from __future__ import annotations

import json

import numpy as np
import pytest

EOS = "<|endoftext|>"
WORDS = ("the cat sat on a mat while dogs ran far away into green hills under bright skies and "
         "seven wise owls counted forty silver stars above quiet rivers near caf\u00e9s \u2603").split()


def random_documents(n: int, seed: int) -> list[str]:
    """``n`` random documents of :data:`WORDS` (one to four lines each, some indented)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(WORDS, rng.integers(3, 14))) for _ in range(rng.integers(1, 5))]
        docs.append("\n".join(lines) + ("\n\n  indented line\n" if rng.random() < 0.3 else "."))
    return docs


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer of about 400 tokens trained on our corpus: its directory
    (tokenizer.json + tokenizer_config.json naming EOS) and the Tokenizer."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(random_documents(400, 0), trainer)
    root = tmp_path_factory.mktemp("bpe")
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return root, tok


@pytest.fixture
def corpus(tmp_path):
    """Two text files and a .jsonl under a directory; (the files in prepare's order, the
    documents of each)."""
    docs = random_documents(60, 1)
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text(docs[0])
    (root / "b" / "c.txt").write_text(docs[1])
    (root / "b" / ".hidden").write_text("never read")
    with open(root / "b" / "d.jsonl", "w") as fh:
        for d in docs[2:]:
            fh.write(json.dumps({"text": d, "n": 1}) + "\n")
        fh.write("\n")  # a blank line is no document
    files = [root / "a.txt", root / "b" / "c.txt", root / "b" / "d.jsonl"]
    return [str(f) for f in files], [[docs[0]], [docs[1]], docs[2:]]


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A word-level tokenizer (the tokenizers library) of a few words, with its EOS named."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["</s>", "[UNK]", "the", "cat", "sat", "on", "mat"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    root = tmp_path / "tok"
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return root


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML chat template (Qwen's markup): its special tokens mark every turn."""


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A byte-level BPE tokenizer with the special tokens ``</s>`` (its EOS), ``<|im_start|>``
    and ``<|im_end|>`` and the :data:`CHATML` template: its directory and the Tokenizer."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(random_documents(400, 0), trainer)
    root = tmp_path_factory.mktemp("chatml")
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                            "chat_template": CHATML}))
    return root, tok
