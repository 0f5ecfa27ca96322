"""Generation with a KV cache on one rank: greedy output equal to transformers' ``generate`` token
for token on a random tiny Llama (float64, :mod:`generation`), the sampling rules against their
definition, a tokenizer's prompt and text, bad input exits 2. Every tp x pp layout:
mpi/test_generate.py; a TP=2 sharded checkpoint under mpirun: e2e/test_generate.py."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
from mpi4py import MPI

from generation import (NEW, PROMPT, V, build_generator, hf_dir,  # noqa: F401  (fixtures)
                        transformers_greedy, transformers_llama)
from layouts import small_config, token_source
from mpipar import generate
from mpipar.inference.sampling import Sampling, candidates, next_token
from mpipar.rules import validate
from mpipar.runtime.comm import Group, Ledger
from small_tokenizers import EOS, bpe  # noqa: F401  (the BPE tokenizer fixture)


# ------------------------------------------------------------------------------ sampling
def test_greedy_top_k_and_top_p_keep_what_they_define():
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5])
    assert next_token(logits, Sampling(0.0), np.random.default_rng(0)) == 1  # lowest of the ties
    ids, prob = candidates(logits, Sampling(0.5))
    assert ids.tolist() == [1, 3, 2, 0, 5, 4]             # by logit, ties by id
    want = np.exp(logits[ids] / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(prob, want, rtol=1e-14)
    ids, prob = candidates(logits, Sampling(1.0, top_k=3))
    np.testing.assert_allclose(prob, np.exp([3.0, 3.0, 2.0]) / np.exp([3.0, 3.0, 2.0]).sum())
    full = np.exp(logits[[1, 3, 2, 0]]) / np.exp(logits).sum()   # cumulative .37 .74 .88 .93
    ids, _ = candidates(logits, Sampling(1.0, top_p=0.8))
    assert ids.tolist() == [1, 3, 2] and full[:2].sum() < 0.8 <= full[:3].sum()
    assert candidates(logits, Sampling(1.0, top_p=0.1))[0].tolist() == [1]  # at least one


def test_sampled_frequencies_follow_the_kept_probabilities():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    rng, draws = np.random.default_rng(7), 20000
    picks = np.bincount([next_token(logits, Sampling(1.0, top_k=4), rng) for _ in range(draws)],
                        minlength=5)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.0]) / 0.95
    assert picks[4] == 0
    assert np.all(np.abs(picks / draws - p) <= 4 * np.sqrt(p * (1 - p) / draws) + 1e-12), picks
    again = [next_token(logits, Sampling(0.7, 3, 0.9), np.random.default_rng(3)) for _ in range(5)]
    assert len(set(again)) == 1  # a function of the logits and the seed


@pytest.mark.parametrize("kwargs,rule", [(dict(temperature=-1.0), "--temperature -1.0"),
                                         (dict(top_k=-2), "--top-k -2"),
                                         (dict(top_p=0.0), "--top-p 0.0")])
def test_bad_sampling_settings_are_named(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        Sampling(**kwargs)


# ------------------------------------------------------------------- against transformers
def test_greedy_equals_transformers_generate_on_one_rank(hf_dir, transformers_llama):
    from mpipar.checkpoint.huggingface import load_hf
    model_cfg, params = load_hf(hf_dir)
    generator = build_generator(model_cfg, MPI.COMM_SELF)
    generator.load_params(params)
    prompt = list(PROMPT.encode())
    got = generator.generate(prompt, NEW, Sampling(0.0), keep_logits=True)
    want, logits = transformers_greedy(transformers_llama, hf_dir, prompt, NEW)
    err = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, logits))
    print(f"\ngreedy ids {got.ids}; KV-cache logits vs transformers' float64 forward: max rel "
          f"diff {err:.2e}")
    assert got.ids == want and got.stopped == "length"
    assert err <= 1e-10
    first = got.ids[0]  # stops after the end-of-document token
    stopped = generator.generate(prompt, NEW, Sampling(0.0), eos=first)
    assert (stopped.ids, stopped.stopped) == ([first], "eos")


def test_a_tokenizer_encodes_the_prompt_and_decodes_the_text(tmp_path, bpe, capsys,  # noqa: F811
                                                             monkeypatch):
    """A Hugging Face directory with its own tokenizer.json: the prompt is its encoding (no
    special tokens), the text its decoding of the ids."""
    from mpipar.checkpoint.huggingface import save_hf
    from mpipar.model.params import init_params
    root, tok = bpe
    from mpipar.layout import resolve_model
    cfg = resolve_model(small_config().model)
    cfg.vocab_size = tok.get_vocab_size()
    model = tmp_path / "model"
    save_hf(model, cfg, init_params(cfg, 3, np.float64))
    (model / "tokenizer.json").write_text((root / "tokenizer.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    assert generate.main([str(model), "--prompt", "the cat sat", "--max-new-tokens", "6",
                          "--seed", "2", "--json", "--backend", "numpy"], MPI.COMM_SELF) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == tok.encode("the cat sat", add_special_tokens=False).ids
    assert out["text"] == tok.decode(out["ids"], skip_special_tokens=False)
    assert len(out["ids"]) == 6 or out["ids"][-1] == tok.token_to_id(EOS)


@pytest.mark.parametrize("extra,rule", [
    (["--top-p", "0"], "--top-p 0.0: must be in"),
    (["--tp", "3"], "= 3 must equal the world size 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--prompt", ""], "encodes to no token"),
])
def test_bad_input_exits_2(tmp_path, capsys, monkeypatch, extra, rule):
    model = _small_checkpoint(tmp_path)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    with pytest.raises(SystemExit) as exc:
        generate.main([model, "--prompt", "x", *extra], MPI.COMM_SELF)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mpipar: error: ") and len(err.splitlines()) == 1
    assert re.search(rule, err), err


def test_a_byte_prompt_needs_a_byte_vocabulary_and_a_model_must_exist(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    for path, rule in ((_small_checkpoint(tmp_path, 13), "bytes tokens go up to id 255, but the "
                                                         "model's vocabulary has 13 ids"),
                       (str(tmp_path / "nothing"), "neither a Hugging Face directory")):
        with pytest.raises(SystemExit) as exc:
            generate.main([path, "--prompt", "x"], MPI.COMM_SELF)
        assert exc.value.code == 2 and rule in capsys.readouterr().err


def _small_checkpoint(tmp_path, vocab_size: int = V) -> str:
    """A one-process checkpoint of the layouts test model with ``vocab_size`` tokens."""
    from mpipar.checkpoint import writer
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    cfg = small_config()
    cfg.model.vocab_size = vocab_size
    cfg = validate(cfg, 1)
    rank = build_rank(cfg, MPI.COMM_SELF, source=token_source())
    return str(writer.save(rank.state, trainer.run_position(rank, 0), tmp_path / "ckpt",
                               Group(MPI.COMM_SELF, "world", Ledger())))
