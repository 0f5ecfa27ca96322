"""``python -m mpipar.data prepare --preference``: pairs written as two rows of the token stream
with a loss mask over the responses, read back by the sampler row by row; bad records refused
naming FILE:LINE with nothing written."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from mpipar.data.cli import main
from mpipar.data.sft import loss_mask_source
from mpipar.data.sources import inputs_targets, load_tokens
from tests.small_tokenizers import tokenizer_dir  # noqa: F401 - fixture

WORDS = ["</s>", "[UNK]", "the", "cat", "sat", "on", "mat"]


def _write(tmp_path, records) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def _read(path):
    with h5py.File(path, "r") as f:
        return np.asarray(f["tokens"]), np.asarray(f["loss_mask"]), dict(f.attrs)


def test_id_pairs_are_two_rows_each_masked_on_the_response(tmp_path, capsys):
    src = _write(tmp_path, [{"prompt_ids": [5, 6], "chosen_ids": [7, 8], "rejected_ids": [9]},
                            "",
                            {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 4, 4, 4],
                             "rejected_ids": [3, 2]}])
    out = tmp_path / "pairs.h5"
    assert main(["prepare", "--preference", src, "--seq-len", "5", "--out", str(out)]) == 0
    tokens, mask, attrs = _read(out)
    assert tokens.tolist() == [5, 6, 7, 8, 0, 5, 6, 9, 0, 0,
                               1, 2, 3, 4, 4, 1, 2, 3, 3, 2, 0]
    assert mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0, 0,
                             0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0]
    assert attrs["preference_pairs"] == 2 and attrs["seq_len"] == 5
    # the sampler's sample j is row j, and its counted targets are the response's tokens
    source = load_tokens(str(out), 16, 5)
    inputs, targets = inputs_targets(source, np.arange(4))
    assert inputs.tolist()[3] == [1, 2, 3, 3, 2] and targets.tolist()[1] == [6, 9, 0, 0, 1]
    masks = loss_mask_source(str(out), 5).sample(np.arange(4))[:, 1:]
    assert masks.tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 0],
                              [0, 0, 1, 1, 0]]


def test_text_pairs_end_their_responses_with_eos(tmp_path, tokenizer_dir):  # noqa: F811
    src = _write(tmp_path, [{"prompt": "the cat", "chosen": "sat on the mat",
                             "rejected": "sat"}])
    out = tmp_path / "pairs.h5"
    assert main(["prepare", "--preference", src, "--tokenizer", str(tokenizer_dir),
                 "--seq-len", "6", "--out", str(out)]) == 0
    tokens, mask, attrs = _read(out)
    ids = {w: i for i, w in enumerate(WORDS)}
    chosen = [ids[w] for w in "the cat sat on the mat".split()]
    rejected = [ids[w] for w in "the cat sat </s>".split()] + [0, 0]
    assert tokens.tolist() == chosen + rejected + [0]   # the chosen EOS is cut
    assert mask.tolist() == [0, 0, 1, 1, 1, 1] + [0, 0, 1, 1, 0, 0] + [0]
    assert attrs["eos_id"] == 0 and attrs["preference_pairs"] == 1


def test_a_chat_prompt_is_rendered_with_the_template(tmp_path, tokenizer_dir):  # noqa: F811
    pytest.importorskip("jinja2")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' %}on "
                               "{% endif %}{{ m.content }} {% endfor %}"
                               "{% if add_generation_prompt %}on {% endif %}")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    src = _write(tmp_path, [{"prompt": [{"role": "user", "content": "the cat"}],
                             "chosen": "sat", "rejected": "mat"}])
    out = tmp_path / "pairs.h5"
    assert main(["prepare", "--preference", src, "--tokenizer", str(tokenizer_dir),
                 "--seq-len", "5", "--out", str(out)]) == 0
    tokens, mask, _ = _read(out)
    # prompt "the cat on " (the generation prompt), each response what the conversation with it
    # as the assistant's reply adds to it, then EOS
    assert tokens.tolist() == [2, 3, 5, 4, 0] + [2, 3, 5, 6, 0] + [0]
    assert mask.tolist() == [0, 0, 0, 1, 1] + [0, 0, 0, 1, 1] + [0]


BAD = [
    ("missing field", {"prompt": "the", "chosen": "cat"}, "has no field 'rejected'"),
    ("missing id field", {"prompt_ids": [1], "chosen_ids": [2]}, "has no field 'rejected_ids'"),
    ("negative id", {"prompt_ids": [1], "chosen_ids": [-2], "rejected_ids": [3]},
     "field 'chosen_ids' must be a list of token ids"),
    ("not an object", [1, 2], "a record is a JSON object"),
    ("not json", "{", "not JSON"),
    ("cut to nothing", {"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5], "rejected_ids": [6]},
     "the chosen response has no token left within --seq-len 4"),
    ("text without tokenizer", {"prompt": "the", "chosen": "cat", "rejected": "sat"},
     "a text record needs --tokenizer"),
]


@pytest.mark.parametrize("record,message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_records_exit_2_naming_the_line_and_write_nothing(tmp_path, capsys, record, message):
    good = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}
    src = _write(tmp_path, [good, record, good])
    out = tmp_path / "pairs.h5"
    assert main(["prepare", "--preference", src, "--seq-len", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src}:2: " in err and message in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".pairs.h5.*"))
