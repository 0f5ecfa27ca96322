"""``python -m mpipar.data``: inspect a token source (``info``) and prepare one from text
(``prepare``, bytes or a Hugging Face tokenizer's ids)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpipar.data.documents import expand_inputs
from mpipar.data.prepare import prepare_tokens
from mpipar.data.sources import DataError, load_tokens, recorded_tokenizer
from mpipar.data.tokenizer import prepare_tokenized


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpipar.data",
                                     description="Inspect and prepare token sources.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="check a source and print its size and tokenizer")
    info.add_argument("path", help="a file, a directory, or 'stdlib' for the built-in corpus")
    info.add_argument("--seq-len", type=int, default=128,
                      help="tokens per sample input (default: 128, training's default)")
    info.add_argument("--vocab-size", type=int,
                      help="token ids must be below this (default: the vocabulary of the tokenizer "
                           "recorded in the file, else 256)")
    prep = commands.add_parser(
        "prepare", help="write text as an HDF5 token stream: bytes, or --tokenizer ids")
    prep.add_argument("texts", nargs="+", metavar="INPUT",
                      help="text files or directories (their files, recursively, sorted), "
                           "concatenated in order; with --tokenizer also .jsonl and .parquet "
                           "files")
    prep.add_argument("--out", required=True, help="output .h5 file (dataset 'tokens')")
    prep.add_argument("--tokenizer", metavar="HF_DIR_OR_JSON",
                      help="encode with this Hugging Face tokenizer (a directory holding "
                           "tokenizer.json, or the file); default: byte tokens (vocabulary 256)")
    prep.add_argument("--eos", metavar="TOKEN",
                      help="end-of-document token (default: eos_token of tokenizer_config.json)")
    prep.add_argument("--text-field", default="text",
                      help="the text field of .jsonl records and Parquet rows (default: text)")
    prep.add_argument("--sft", action="store_true",
                      help="INPUT is one JSONL file of {prompt, completion} (or chat messages) "
                           "records: write each "
                           "as prompt + completion + EOS with a loss_mask stream (1 on the "
                           "completion and its EOS) for --loss-mask; needs --tokenizer")
    prep.add_argument("--parse-special-tokens", action="store_true",
                      help="text that spells a special token (</s>, <|im_end|>) becomes that "
                           "token, for data that carries control tokens (default: it stays "
                           "text; a chat template's own special tokens are tokens either way)")
    prep.add_argument("--preference", action="store_true",
                      help="INPUT is one JSONL file of {prompt, chosen, rejected} text records "
                           "(with --tokenizer; the prompt may be chat messages) or {prompt_ids, "
                           "chosen_ids, rejected_ids}: write each pair as two --seq-len rows "
                           "with a loss_mask over the responses, for --objective dpo "
                           "(packed with --pack-pairs at training)")
    prep.add_argument("--seq-len", type=int, default=128,
                      help="with --preference: tokens per sequence, training's --seq-len "
                           "(default: 128)")
    prep.add_argument("--workers", type=int, default=0,
                      help="processes encoding files in parallel (default 0: one per CPU, at "
                           "most one per file); the output does not depend on it")
    return parser


def _prepare_command(args: argparse.Namespace) -> None:
    if args.preference:
        if args.sft or len(args.texts) != 1:
            raise DataError("--preference needs one JSONL file of preference pairs (and not "
                            "--sft)")
        from mpipar.data.preference import prepare_preference
        done = prepare_preference(args.texts[0], args.out, args.seq_len, args.tokenizer, args.eos)
        print(f"wrote {args.out}: {done.pairs} preference pair(s) as rows of {done.seq_len} "
              f"tokens, {done.response_tokens} response tokens (loss_mask 1); train with "
              f"--objective dpo --seq-len {done.seq_len}")
        return
    if args.sft:
        if args.tokenizer is None or len(args.texts) != 1:
            raise DataError("--sft needs --tokenizer and one JSONL file of prompt/completion "
                            "records")
        from mpipar.data.sft import prepare_sft
        tokens, examples, counted = prepare_sft(args.texts[0], args.out, args.tokenizer, args.eos,
                                               args.parse_special_tokens)
        print(f"wrote {args.out}: {tokens} tokens in {examples} example(s), {counted} of them "
              f"completion tokens (loss_mask 1); train with --loss-mask")
        return
    if args.tokenizer is None:
        extra = [f for f in ("eos", "workers", "parse_special_tokens") if getattr(args, f)]
        extra += ["text_field"] if args.text_field != "text" else []
        if extra:
            raise DataError(f"--{extra[0].replace('_', '-')} needs --tokenizer (without it, "
                            f"prepare writes the files' bytes)")
        files = expand_inputs(args.texts)   # a directory: its files, as --data DIR reads them
        total = prepare_tokens(files, args.out)
        print(f"wrote {args.out}: {total} byte tokens (vocabulary 256) from "
              f"{len(files)} file(s)")
        return
    done = prepare_tokenized(args.texts, args.out, args.tokenizer, args.eos, args.text_field,
                             args.workers, parse_special=args.parse_special_tokens)
    print(f"wrote {args.out}: {done.tokens} tokens ({done.tokenizer.dtype}) in {done.documents} "
          f"document(s) from {len(done.files)} file(s); tokenizer {done.tokenizer.name}, "
          f"vocabulary {done.tokenizer.vocab_size}, EOS {done.tokenizer.eos_token!r} = "
          f"{done.tokenizer.eos_id}; train with --vocab-size {done.tokenizer.vocab_size}")


def _info_command(args: argparse.Namespace) -> None:
    recorded = None if args.path == "stdlib" else recorded_tokenizer(args.path)
    vocab = args.vocab_size or (recorded["tokenizer_vocab_size"] if recorded else 256)
    src = load_tokens(args.path, vocab, args.seq_len)
    rows = [("path", src.path), ("format", src.format), ("kind", src.kind),
            ("dtype", src.dtype), ("shape", list(src.shape)), ("tokens", src.num_tokens),
            ("seq_len", src.seq_len), ("samples", src.num_samples), ("vocab", vocab)]
    for key, value in rows:
        print(f"{key + ':':<10}{value}")
    if src.tokenizer:
        tok = src.tokenizer
        print("tokenizer:")
        for key, value in (("name", tok["tokenizer"]), ("vocab_size", tok["tokenizer_vocab_size"]),
                           ("sha256", tok["tokenizer_sha256"]),
                           ("eos", f"{tok['eos_token']!r} = {tok['eos_id']}"),
                           ("documents", tok.get("documents", "?"))):
            print(f"  {key + ':':<12}{value}")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mpipar.data info PATH [--seq-len S] [--vocab-size V]`: load and check a source,
    print its format, kind, dtype, token count, number of samples and recorded tokenizer.
    `python -m mpipar.data prepare INPUT... --out tokens.h5 [--tokenizer T]`: see
    :func:`mpipar.data.prepare.prepare_tokens` (bytes) and
    :func:`mpipar.data.tokenizer.prepare_tokenized`; with `--sft` :mod:`mpipar.data.sft`, with
    `--preference` :mod:`mpipar.data.preference`.
    Exit status 2 on DataError."""
    args = _parser().parse_args(argv)
    try:
        (_prepare_command if args.command == "prepare" else _info_command)(args)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
