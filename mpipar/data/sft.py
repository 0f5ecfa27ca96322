"""Supervised fine-tuning data: prompt/completion pairs with a loss mask (``--loss-mask``).

``python -m mpipar.data prepare --sft PAIRS.jsonl --tokenizer DIR --out OUT.h5`` reads JSONL
records ``{"prompt": str, "completion": str}``, or ``{"messages": [{"role", "content"}, ...]}``
rendered with the tokenizer's chat template (``chat_template`` of its tokenizer_config.json,
Jinja, sandboxed): the prompt is the conversation before the last message with the generation
prompt, the completion what the whole conversation adds to it. It writes one token stream of
examples, each ``prompt ids + completion ids + EOS`` (the EOS unless the completion already
ends with it; so ``--document-masking`` keeps examples apart), beside a
``loss_mask`` stream of the same length: 0 on the prompt's tokens, 1 on the completion's and on
its EOS. A target carries loss with ``--loss-mask`` iff the token it predicts has mask 1: the
model learns the completions (and to end them), never the prompts. The file records the
tokenizer as ``prepare --tokenizer`` does, and ``examples``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from mpipar.data.prepare import hdf5_output, output_file
from mpipar.data.sources import DataError, H5_SUFFIXES, TokenSource, _h5_dataset

MASK = "loss_mask"


MAX_RECORD_BYTES = 1 << 20
"""The longest JSONL line (one record) ``prepare --sft`` reads: a record is encoded whole, so
its size is bounded before it is read (a long conversation of 100k tokens is ~0.5 MiB)."""


def jsonl_records(path: str | os.PathLike, what: str = "--sft"):
    """(line number, parsed record) of every non-blank line of the JSONL file ``path``, read one
    line at a time (at most :data:`MAX_RECORD_BYTES`); DataError naming the line and the rule
    for a line that is too long, not UTF-8, not JSON (or nested too deeply), or whose text is
    not text (a lone surrogate). ``what`` names the flag in the length error."""
    with open(path, "rb") as fh:
        n = 0
        while raw := fh.readline(MAX_RECORD_BYTES + 1):
            n += 1
            if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                raise DataError(f"{path}:{n}: a record longer than {MAX_RECORD_BYTES} bytes "
                                f"(the bound on one {what} record)")
            if raw.strip():
                yield n, _record(raw, f"{path}:{n}")


def _records(path: str | os.PathLike):
    """(line number, prompt, completion) of every record of the JSONL file ``path``
    (:func:`jsonl_records`); for a chat record, (line number, messages, None)."""
    for n, rec in jsonl_records(path):
        if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            yield n, rec["messages"], None
            continue
        if not (isinstance(rec, dict) and isinstance(rec.get("prompt"), str)
                and isinstance(rec.get("completion"), str)):
            raise DataError(f"{path}:{n}: a record needs string fields 'prompt' and "
                            f"'completion', or a list 'messages'")
        yield n, rec["prompt"], rec["completion"]


def _record(raw: bytes, where: str):
    """One JSONL line parsed; DataError naming ``where`` and the rule."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 (byte {err.start}: {raw[err.start:err.start + 4]!r})"
                        ) from None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err.msg})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply for a record") from None
    _require_text(rec, where)
    return rec


def _require_text(value, where: str) -> None:
    """Every string of a parsed record is text: a lone surrogate (``"\\ud800"`` in JSON)
    cannot be encoded, so it is refused here rather than inside the tokenizer."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as err:
                raise DataError(f"{where}: holds a lone surrogate "
                                f"({v[err.start]!r}), not text") from None
        elif isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v


def chat_template(tokenizer: str | os.PathLike) -> tuple[str, dict]:
    """(the Jinja chat template, the special tokens it may read) of ``tokenizer``'s
    tokenizer_config.json."""
    from mpipar.data.tokenizer import tokenizer_file
    config = tokenizer_file(tokenizer).with_name("tokenizer_config.json")
    data = json.loads(config.read_text()) if config.is_file() else {}
    if not isinstance(data.get("chat_template"), str):
        raise DataError(f"--tokenizer {tokenizer}: chat messages need a chat_template in "
                        f"{config}")
    special = {k: (v.get("content") if isinstance(v, dict) else v) or ""
               for k, v in data.items() if k in ("bos_token", "eos_token")}
    return data["chat_template"], special


def render_chat(template: str, special: dict, messages: list, where: str) -> tuple[str, str]:
    """(prompt, completion) texts of a conversation (module docstring)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat messages need the jinja2 package") from None

    def fail(message: str) -> None:
        raise DataError(f"{where}: the chat template refused the record: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    if len(messages) < 2:
        raise DataError(f"{where}: 'messages' needs the conversation and its last reply")
    try:
        render = env.from_string(template).render
        whole = render(messages=messages, add_generation_prompt=False, **special)
        prompt = render(messages=messages[:-1], add_generation_prompt=True, **special)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a template does is the data's fault
        raise DataError(f"{where}: the chat template failed on the record "
                        f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if not whole.startswith(prompt):
        raise DataError(f"{where}: the rendered conversation does not start with its prompt")
    return prompt, whole[len(prompt):]


def prepare_sft(path: str | os.PathLike, out: str | os.PathLike, tokenizer: str | os.PathLike,
                eos: str | None = None) -> tuple[int, int, int]:
    """Write the examples of ``path`` to ``out`` (module docstring) -> (tokens, examples,
    tokens with mask 1)."""
    from mpipar.data.tokenizer import load_tokenizer
    out = output_file(out)
    tok, spec = load_tokenizer(tokenizer, eos)
    ids, mask, chat = [], [], None
    for n, prompt, completion in _records(path):
        if completion is None:
            chat = chat or chat_template(tokenizer)
            prompt, completion = render_chat(*chat, prompt, f"{path}:{n}")
        p = tok.encode(prompt, add_special_tokens=False).ids
        c = tok.encode(completion, add_special_tokens=False).ids
        c = c if c and c[-1] == spec.eos_id else c + [spec.eos_id]
        ids += [p, c]
        mask += [np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)]
    if not ids:
        raise DataError(f"{path}: no prompt/completion records")
    tokens, flags = np.concatenate(ids).astype(spec.dtype), np.concatenate(mask)
    with hdf5_output(out) as (f, _):
        f.create_dataset("tokens", data=tokens)
        f.create_dataset(MASK, data=flags)
        f.attrs.update(spec.attrs())
        f.attrs.update({"documents": len(ids) // 2, "examples": len(ids) // 2})
    return len(tokens), len(ids) // 2, int(flags.sum())


def loss_mask_source(path: str, seq_len: int) -> TokenSource:
    """The ``loss_mask`` stream of a prepared SFT file, cut into samples as its tokens are."""
    if Path(path).suffix.lower() not in H5_SUFFIXES or not Path(path).is_file():
        raise DataError(f"--loss-mask: {path or 'the built-in corpus'} is not an HDF5 file "
                        f"written by data prepare --sft")
    with h5py.File(path, "r") as f:
        if MASK not in f or f[MASK].shape != f["tokens"].shape:
            raise DataError(f"--loss-mask: {path} has no '{MASK}' stream beside its tokens "
                            f"(write it with data prepare --sft)")
        shape, dtype = f[MASK].shape, f[MASK].dtype
    return TokenSource(path, "hdf5", seq_len, shape, dtype, _h5_dataset(path, MASK))
