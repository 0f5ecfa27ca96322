"""``python -m mpipar.generate CHECKPOINT_OR_HF_DIR --prompt TEXT``: sample text from a model.

    python -m mpipar.generate runs/exp1/checkpoints --prompt "def main(" --max-new-tokens 64
    mpirun -n 4 python -m mpipar.generate runs/exp1/checkpoints --tp 2 --pp 2 --prompt "import "
    python -m mpipar.generate path/to/llama --prompt "Once upon a time" --temperature 0.8 \\
        --top-k 40 --top-p 0.95 --seed 1

The model is an mpipar checkpoint (a ``step_N`` directory, or a save directory whose ``latest``
names one), read directly under this run's layout whatever layout saved it; or a Hugging Face
Llama directory (``config.json`` + safetensors). A LoRA run's checkpoint holds its adapters
alone: it generates from the run's model, the adapters merged into the run's base (its
``--init-from-hf``, else its seed's initialisation) as ``python -m mpipar.ckpt merge-adapter``
merges them, every rank reading the whole. The layout is ``world = tp x pp`` (``--tp``
defaults to the world / ``--pp``). Decoding keeps a KV cache (:mod:`mpipar.inference.generator`).

Tokens: ``--tokenizer`` (a Hugging Face directory holding ``tokenizer.json``, or the file; the
``tokenizers`` library) encodes the prompt and decodes the output, and generation stops at its
end-of-document token; a Hugging Face model directory holding a ``tokenizer.json`` is its own
default. Otherwise tokens are UTF-8 bytes (byte-level models: vocabulary >= 256), with no
end-of-document token. The prompt is encoded without the tokenizer's special-token template
(no BOS), as ``python -m mpipar.data prepare`` encodes documents; ``--add-special-tokens`` adds
it (what a pretrained Hugging Face model expects).

``--temperature 0`` is greedy; otherwise the next token is sampled (``--top-k``, ``--top-p``)
from a generator seeded by ``--seed``: the same output on every layout (:mod:`mpipar.inference.sampling`).
Rank 0 prints the prompt followed by the generated text, or with ``--json`` one JSON object
(``prompt_ids``, ``ids``, ``text``, ``stopped``). Bad arguments or an unusable model: exit
status 2 on every rank, before any collective. Before anything is allocated, the busiest
rank's least memory (weights and the KV cache of the prompt and the new tokens, from the sizes
alone) is checked against the node's, then the stored tensors' shapes against the config, then
(once the ranks know how many share a node) each rank's predicted peak against its share
(:func:`check_model`, :mod:`mpipar.plan.admission`; ``--allow-oversubscribed-memory`` skips the
memory).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mpipar.runtime.mpi_init import MPI

from mpipar.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from mpipar.layout import Layout

HF_CONFIG = "config.json"
BYTE_VOCAB = 256
_GENERATION_DTYPES = ("float32", "float64")  # a model saved in another dtype generates in float32


@dataclass(frozen=True)
class Codec:
    """Text to token ids and back: a Hugging Face tokenizer, or UTF-8 bytes."""

    name: str
    vocab_size: int                      # ids it produces are below this
    eos: int | None                      # the end-of-document id, if any
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def byte_codec() -> Codec:
    """UTF-8 bytes; ids of 256 and above (a model with a larger vocabulary) decode as U+FFFD."""
    def decode(ids: list[int]) -> str:
        return b"".join(bytes([i]) if i < BYTE_VOCAB else "\ufffd".encode() for i in ids
                        ).decode("utf-8", errors="replace")

    return Codec("bytes", BYTE_VOCAB, None, lambda text: list(text.encode("utf-8")), decode)


def tokenizer_codec(path: str, add_special_tokens: bool) -> Codec:
    """The Hugging Face tokenizer at ``path`` (:func:`mpipar.data.tokenizer.load_tokenizer`)."""
    from mpipar.data.tokenizer import load_tokenizer
    # a prompt is the operator's own text: its chat markup is special tokens
    tokenizer, spec = load_tokenizer(path, parse_special=True)
    return Codec(spec.name, spec.vocab_size, spec.eos_id,
                 lambda text: tokenizer.encode(text, add_special_tokens=add_special_tokens).ids,
                 lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpipar.generate",
        description="Generate text from an mpipar checkpoint or a Hugging Face Llama directory, "
                    "with a KV cache, on one rank or under mpirun with --tp/--pp.")
    parser.add_argument("model", metavar="CHECKPOINT_OR_HF_DIR",
                        help="an mpipar checkpoint (step directory or save directory) or a "
                             "Hugging Face Llama directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokenizer", metavar="HF_DIR_OR_JSON",
                        help="Hugging Face tokenizer (default: the model directory's own "
                             "tokenizer.json if any, else UTF-8 bytes)")
    parser.add_argument("--add-special-tokens", action="store_true",
                        help="encode the prompt with the tokenizer's special-token template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: 64")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="0 is greedy (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens "
                                                             "(default 0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="keep the likeliest tokens up to this probability (default 1: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--tp", type=int, default=0,
                        help="tensor-parallel size (default: the world / --pp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    parser.add_argument("--dtype", choices=("float32", "float64"),
                        help="compute dtype (default: the checkpoint's training dtype, "
                             "float32 for a bfloat16 run's; a Hugging Face directory's own if "
                             "float32/float64, else float32)")
    parser.add_argument("--backend", default="auto", choices=("auto", "numba", "numpy"),
                        help="kernel backend (default: auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--allow-oversubscribed-memory", action="store_true",
                        help="start even when the weights and KV cache a rank needs exceed its "
                             "share of the node's available memory")
    return parser


def read_model(path: str) -> tuple[ModelConfig, str, str]:
    """(model config, its dtype, kind "hf" or "checkpoint") of ``path``. Reads metadata only."""
    if (Path(path) / HF_CONFIG).is_file():
        from mpipar.checkpoint import huggingface as hf
        raw = hf.read_config_json(path)
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        return (hf.read_model_config(path, untie_embeddings=True),
                dtype if dtype in _GENERATION_DTYPES else "float32", "hf")
    from mpipar.checkpoint.directory import INDEX, LATEST, resolve_path
    from mpipar.checkpoint.reader import read_config
    if not (resolve_path(path) / INDEX).is_file():
        raise ConfigError(f"{path}: neither a Hugging Face directory ({HF_CONFIG}) nor an "
                          f"mpipar checkpoint ({INDEX}, or a save directory's {LATEST})")
    saved = read_config(path)   # a bf16 run's checkpoint holds float32 masters
    dtype = saved.train.dtype
    return saved.model, dtype if dtype in _GENERATION_DTYPES else "float32", "checkpoint"


def resolve(args: argparse.Namespace, world: int) -> tuple[Layout, str, Codec]:
    """The generation config (validated by every component's rules for world = tp x pp), the
    model's kind and the codec; ConfigError, DataError or CheckpointError on bad input."""
    from mpipar.inference.sampling import Sampling
    Sampling(args.temperature, args.top_k, args.top_p)  # ValueError names the flag's value
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1),
                               ("--seed", args.seed, 0), ("--tp", args.tp, 0),
                               ("--pp", args.pp, 1)):
        if value < least:
            raise ConfigError(f"{flag} {value}: must be >= {least}")
    model, dtype, kind = read_model(args.model)
    tp = args.tp or max(1, world // args.pp)
    train = TrainConfig(seq_len=1, global_batch_size=1, micro_batch_size=1,
                        dtype=args.dtype or dtype, backend=args.backend)
    from mpipar.rules import validate
    cfg = validate(Config(model, ParallelConfig(dp=1, tp=tp, pp=args.pp), train), world)
    own = Path(args.model) / "tokenizer.json"
    tokenizer = args.tokenizer or (str(Path(args.model)) if kind == "hf" and own.is_file()
                                   else None)
    codec = tokenizer_codec(tokenizer, args.add_special_tokens) if tokenizer else byte_codec()
    if codec.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"{codec.name} tokens go up to id {codec.vocab_size - 1}, but the "
                          f"model's vocabulary has {cfg.model.vocab_size} ids")
    return cfg, kind, codec


def encode_prompt(codec: Codec, prompt: str) -> list[int]:
    """The ids of ``prompt``: ConfigError when it is not text (an argument that is not UTF-8
    reaches Python as lone surrogates) or encodes to no token."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(prompt[exc.start])
        what = (f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                else f"the lone surrogate U+{code:04X}")
        raise ConfigError(f"--prompt is not UTF-8 text: {what} at character {exc.start}") from None
    ids = codec.encode(prompt)
    if not ids:
        raise ConfigError(f"--prompt {prompt!r}: encodes to no token")
    return ids


def check_model(args: argparse.Namespace, cfg: Layout, kind: str, positions: int,
                on_node: int) -> int:
    """Before anything is allocated, with no collective (every rank gets the same answer):
    the busiest rank's least memory (:func:`mpipar.plan.admission.check_generation_bound`:
    weights and the KV cache of ``positions`` positions) against its share of the node's available memory (``on_node``
    ranks at least share it), so that a config claiming an absurd model is refused at once;
    then the stored tensors' number and shapes against the config. Returns the bytes every
    rank reads whole (a Hugging Face directory; 0 for a checkpoint). Raises ConfigError or
    CheckpointError."""
    from mpipar.plan.admission import check_generation_bound
    check_generation_bound(cfg, positions, on_node, args.max_new_tokens,
                           args.allow_oversubscribed_memory)
    if kind == "hf":
        from mpipar.checkpoint import huggingface as hf
        root = Path(args.model)
        _require_layers(args.model, cfg.model, len(hf.weight_files(root)))
        raw = hf.read_config_json(root)
        return hf.stored_bytes(hf.check_tensors(root, raw, cfg.model),
                               raw.get("model_type", "llama"))
    from mpipar.checkpoint.directory import resolve_path
    from mpipar.checkpoint.index import read_index
    from mpipar.checkpoint.reader import read_config, require_config_shapes
    path = resolve_path(args.model)
    require_config_shapes(path, read_index(path))
    if read_config(path).train.lora_rank:
        # a LoRA run's checkpoint: every rank reads the base and merges it in float64
        from mpipar.plan.memory import parameter_count
        return 16 * parameter_count(cfg.model)
    return 0


def _require_layers(path: str, model: ModelConfig, tensors: int) -> None:
    """Each layer has tensors of its own: a Hugging Face config claiming more layers than
    ``path`` stores tensors is refused before the tensors it implies are listed (a checkpoint's:
    :func:`mpipar.checkpoint.reader.require_config_shapes`)."""
    if model.layers > tensors:
        raise ConfigError(f"{path}: its config claims {model.layers:,} layers, but it stores "
                          f"{tensors} tensors")


def _load(generator, path: str, kind: str, comm: MPI.Comm) -> None:
    """The parameters of ``generator``'s shards from the model at ``path`` (an mpipar checkpoint
    verified by the ranks of ``comm`` together)."""
    if kind == "hf":
        from mpipar.checkpoint.huggingface import load_hf, load_selection_biases
        generator.load_params(load_hf(path, untie_embeddings=True)[1],
                              load_selection_biases(path))
        return
    from mpipar.checkpoint.reader import Peers, open_reader, read_config, read_moe_bias
    if read_config(path).train.lora_rank:   # the adapters alone: merged into the run's base
        from mpipar.checkpoint.tools import merged_model
        generator.load_params(merged_model(path)[1])
        return
    with open_reader(path, Peers.of(comm)) as read:
        generator.load_checkpoint(read, read_moe_bias(path))


def _agree(comm: MPI.Comm, error: str | None) -> None:
    """Every rank's error (None: none) gathered: any one stops every rank with status 2."""
    from mpipar.training.failure import fail_usage
    failed = [e for e in comm.allgather(error) if e]
    if failed:
        fail_usage(failed[0], comm)


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> int:
    comm = MPI.COMM_WORLD if comm is None else comm
    from mpipar.training.failure import FailureReport, fail_usage, install_abort_hook
    install_abort_hook(FailureReport(comm))
    args = build_parser().parse_args(argv)
    from mpipar.runtime.nodes import configure_threads, local_size_from_env, ranks_on_node
    known = local_size_from_env() or (1 if comm.Get_size() == 1 else None)
    if known:
        configure_threads(known)
    try:  # ConfigError, DataError, CheckpointError and the sampling settings' are ValueErrors
        cfg, kind, codec = resolve(args, comm.Get_size())
        prompt = encode_prompt(codec, args.prompt)
        positions = len(prompt) + args.max_new_tokens
        read_whole = check_model(args, cfg, kind, positions, known or 1)
    except (ValueError, OSError) as exc:
        fail_usage(str(exc), comm)
    on_node = known or ranks_on_node(comm.allgather(MPI.Get_processor_name()), comm.Get_rank())
    if not known:
        configure_threads(on_node)  # a value the user set stays
    error = None
    try:
        from mpipar.plan.admission import check_generation_memory
        check_generation_memory(cfg, comm.Get_rank(), on_node, positions, len(prompt),
                                read_whole, args.max_new_tokens, args.allow_oversubscribed_memory)
    except ConfigError as exc:
        error = str(exc)
    _agree(comm, error)
    from mpipar.inference.generator import Generator
    from mpipar.inference.sampling import Sampling
    generator = Generator(cfg, comm)
    error = None
    try:
        _load(generator, args.model, kind, comm)
    except (ValueError, OSError) as exc:  # a damaged checkpoint or safetensors file
        error = str(exc)
    _agree(comm, error)
    out = generator.generate(prompt, args.max_new_tokens,
                             Sampling(args.temperature, args.top_k, args.top_p), args.seed,
                             codec.eos)
    generator.close()
    if comm.Get_rank() == 0:
        text = codec.decode(out.ids)
        if args.json:
            print(json.dumps({"prompt_ids": prompt, "ids": out.ids, "text": text,
                              "stopped": out.stopped}), flush=True)
        else:
            print(args.prompt + text, flush=True)
    return 0


if __name__ == "__main__":
    # Run the imported module's main (the module's classes are those the other modules use).
    from mpipar.generate import main as _main
    sys.exit(_main())
