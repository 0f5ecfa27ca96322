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
model learns the completions (and to end them), never the prompts. Text of a record that spells
a special token (``</s>``, ``<|im_end|>``) stays text, so a record cannot end or mask itself;
the chat template's own special tokens are those tokens (``--parse-special-tokens`` makes every
such text the token, for data that carries control tokens). The file records the
tokenizer as ``prepare --tokenizer`` does, and ``examples``.
"""
from __future__ import annotations

import json
import os
import re
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
    if len(messages) < 2:
        raise DataError(f"{where}: 'messages' needs the conversation and its last reply")
    whole = _render(template, special, messages, False, where)
    prompt = _render(template, special, messages[:-1], True, where)
    if not whole.startswith(prompt):
        raise DataError(f"{where}: the rendered conversation does not start with its prompt")
    return prompt, whole[len(prompt):]


def _render(template: str, special: dict, messages: list, generation: bool, where: str) -> str:
    """``template`` rendered in Jinja's sandbox; DataError naming ``where`` if it fails."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat messages need the jinja2 package") from None

    def fail(message: str) -> None:
        raise DataError(f"{where}: the chat template refused the record: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    try:
        return env.from_string(template).render(messages=messages,
                                                add_generation_prompt=generation, **special)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a template does is the data's fault
        raise DataError(f"{where}: the chat template failed on the record "
                        f"({type(exc).__name__}: {str(exc)[:200]})") from None


def chat_ids(tok, chat: tuple[str, dict], messages: list, where: str, parse_special: bool
             ) -> tuple[list[int], list[int]]:
    """The ids of a conversation's (prompt, completion) (module docstring): the chat template's
    own special tokens become those tokens; text of the messages that spells one stays text
    (unless ``parse_special``). When a message spells one, the text between the template's
    special tokens is encoded piece by piece (byte-level BPE gives the ids of the whole)."""
    prompt, completion = render_chat(*chat, messages, where)
    specials = special_tokens(tok)
    if parse_special or not specials:
        return _ids(tok, prompt, True), _ids(tok, completion, True)
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    _refuse_special_fields(messages, pattern, where)
    spans = None
    if any(pattern.search(m["content"]) for m in messages if _has_text(m)):
        spans = _content_spans(chat, messages, prompt + completion, where)
    if not spans:      # no message spells a special token
        return _ids(tok, prompt, True), _ids(tok, completion, True)
    cut = len(prompt)
    return (_markup_ids(tok, specials, pattern, prompt, spans),
            _markup_ids(tok, specials, pattern, completion,
                        [(a - cut, b - cut) for a, b in spans]))


def special_tokens(tok) -> dict[str, int]:
    """The special tokens of ``tok``: text -> id."""
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items()
            if t.special and t.content}


def _has_text(message) -> bool:
    return isinstance(message, dict) and isinstance(message.get("content"), str)


def _refuse_special_fields(messages: list, pattern: re.Pattern, where: str) -> None:
    """Only a message's text (its string ``content``) may spell a special token: anywhere else
    (a role, a name, content parts) the template could place it as markup."""
    stack = [{k: v for k, v in m.items() if k != "content"} if _has_text(m) else m
             for m in messages]
    while stack:
        v = stack.pop()
        if isinstance(v, str) and (found := pattern.search(v)):
            raise DataError(f"{where}: {v[:40]!r} spells the special token {found.group()!r} "
                            f"outside a message's text 'content' (give --parse-special-tokens "
                            f"if the data carries control tokens)")
        if isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v


_MARK = re.compile("\ue000([0-9]+)\ue001")


def _content_spans(chat: tuple[str, dict], messages: list, whole: str, where: str
                   ) -> list[tuple[int, int]]:
    """Where each message's text lies in the rendered conversation ``whole``: the template
    rendered again with a mark in place of each text must give ``whole`` once the texts are
    put back; DataError when the template changes the texts (their place is then unknown)."""
    marked = [dict(m, content=f"\ue000{i}\ue001") if _has_text(m) else m
              for i, m in enumerate(messages)]
    mark_in_record = "\ue000" in json.dumps(messages, ensure_ascii=False)
    pieces = _MARK.split(_render(*chat, marked, False, where))
    text, spans = pieces[0], []
    for i in range(1, len(pieces), 2):
        k = int(pieces[i])
        content = messages[k]["content"] if k < len(messages) and _has_text(messages[k]) else ""
        spans.append((len(text), len(text) + len(content)))
        text += content + pieces[i + 1]
    if text != whole or mark_in_record:
        raise DataError(f"{where}: a message spells a special token, and the chat template "
                        f"changes the messages' text, so its markup cannot be told from the "
                        f"text; remove the token's text, or give --parse-special-tokens to make "
                        f"it the token")
    return spans


def _markup_ids(tok, specials: dict[str, int], pattern: re.Pattern, text: str,
                spans: list[tuple[int, int]]) -> list[int]:
    """The ids of ``text``: each special token's text outside ``spans`` (the messages' texts)
    as that token, everything else as text."""
    ids, at = [], 0
    for found in pattern.finditer(text):
        if not any(a < found.end() and found.start() < b for a, b in spans):
            ids += _ids(tok, text[at:found.start()]) + [specials[found.group()]]
            at = found.end()
    return ids + _ids(tok, text[at:])


def _ids(tok, text: str, parse_special: bool = False) -> list[int]:
    """The ids of ``text``, special tokens' text as those tokens iff ``parse_special``."""
    if not text:
        return []
    kept = tok.encode_special_tokens
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = kept


def prepare_sft(path: str | os.PathLike, out: str | os.PathLike, tokenizer: str | os.PathLike,
                eos: str | None = None, parse_special: bool = False) -> tuple[int, int, int]:
    """Write the examples of ``path`` to ``out`` (module docstring) -> (tokens, examples,
    tokens with mask 1)."""
    from mpipar.data.tokenizer import load_tokenizer
    out = output_file(out)
    tok, spec = load_tokenizer(tokenizer, eos, parse_special)
    ids, mask, chat = [], [], None
    for n, prompt, completion in _records(path):
        if completion is None:
            chat = chat or chat_template(tokenizer)
            p, c = chat_ids(tok, chat, prompt, f"{path}:{n}", parse_special)
        else:
            p, c = _ids(tok, prompt, parse_special), _ids(tok, completion, parse_special)
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
        if MASK not in f or "tokens" not in f or f[MASK].shape != f["tokens"].shape:
            raise DataError(f"--loss-mask: {path} has no '{MASK}' stream beside its tokens "
                            f"(write it with data prepare --sft)")
        shape, dtype = f[MASK].shape, f[MASK].dtype
    return TokenSource(path, "hdf5", seq_len, shape, dtype, _h5_dataset(path, MASK))
