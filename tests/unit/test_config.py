"""Configuration rules, in process: each one names field, value and rule (exit 2); TOML files and
flags; docs/configuration.md's field table. The CLI under mpirun: e2e/test_config.py."""
from __future__ import annotations

import pytest

from mpipar.config import Config, ConfigError, LayerSet, ModelConfig
from mpipar.train import resolve_config

# (flags, world size, expected message fragment) — one row per rule of Config.validate.
RULES = [
    (["--vocab-size", "1"], 1, "model.vocab_size=1: must be at least 2"),
    (["--layers", "0"], 1, "model.layers=0: must be a positive integer"),
    (["--hidden", "100", "--heads", "3"], 1, "model.hidden=100: must be divisible by model.heads=3"),
    (["--hidden", "60", "--heads", "4"], 1, "model.head_dim=15: must be even"),
    (["--kv-heads", "3"], 1, "model.kv_heads=3: must divide model.heads=4"),
    (["--rope-theta", "0"], 1, "model.rope_theta=0.0: must be > 0"),
    (["--rope-factor", "8"], 1, "model.rope_factor=8.0: scales only with model.rope_type linear"),
    (["--rope-type", "linear", "--rope-factor", "0"], 1, "model.rope_factor=0.0: must be > 0"),
    (["--rope-type", "llama3", "--rope-factor", "8"], 1,
     "model.rope_original_max_positions=0: rope_type 'llama3' needs the pretraining context"),
    (["--rope-type", "llama3", "--rope-factor", "8", "--rope-original-max-positions", "64",
      "--rope-low-freq-factor", "4"], 1, "llama3 RoPE needs 0 < low < high"),
    (["--rope-type", "longrope"], 1, "argument --rope-type: invalid choice: 'longrope'"),
    (["--rope-type", "yarn", "--rope-factor", "4"], 1,
     "model.rope_original_max_positions=0: rope_type 'yarn' needs the pretraining context"),
    (["--rope-type", "yarn", "--rope-factor", "0", "--rope-original-max-positions", "8"], 1,
     "model.rope_factor=0.0: must be > 0"),
    (["--rope-type", "yarn", "--rope-factor", "4", "--rope-original-max-positions", "8",
      "--rope-beta-fast", "1"], 1,
     "model.rope_beta_fast=1.0, model.rope_beta_slow=1.0: yarn RoPE needs 0 < beta_slow < "
     "beta_fast"),
    (["--rope-mscale", "1"], 1, "model.rope_mscale=1.0: only with model.rope_type yarn"),
    (["--norm-eps", "0"], 1, "model.norm_eps=0.0: must be > 0"),
    (["--init-std", "-1"], 1, "model.init_std=-1.0: must be > 0"),
    (["--tp", "0"], 1, "parallel.tp=0: must be a positive integer"),
    (["--dp", "-1"], 1, "parallel.dp=-1: must be >= 0"),
    (["--dp", "2", "--tp", "2"], 8, "dp*tp*pp*sp = 2*2*1*1 = 4 must equal the world size 8"),
    (["--tp", "3"], 8, "tp*pp*sp = 3*1*1 = 3 must divide the world size 8"),
    (["--tp", "3", "--heads", "6", "--kv-heads", "2", "--hidden", "96"], 3,
     "parallel.tp=3: must divide model.kv_heads=2"),
    (["--tp", "4", "--heads", "6", "--kv-heads", "6", "--hidden", "96"], 4,
     "parallel.tp=4: must divide model.heads=6"),
    (["--tp", "2", "--ffn-hidden", "33"], 2, "parallel.tp=2: must divide model.ffn_hidden=33"),
    (["--pp", "3"], 3, "parallel.pp*virtual_stages = 3*1 = 3: must divide model.layers=4"),
    (["--pp", "2", "--virtual-stages", "4", "--schedule", "interleaved"], 2,
     "parallel.pp*virtual_stages = 2*4 = 8: must divide model.layers=4"),
    (["--virtual-stages", "2"], 1, "parallel.virtual_stages=2: more than 1 needs --schedule interleaved"),
    (["--schedule", "interleaved"], 1, "parallel.schedule='interleaved': needs parallel.virtual_stages >= 2"),
    (["--virtual-stages", "0"], 1, "parallel.virtual_stages=0: must be a positive integer"),
    (["--sp", "2", "--sp-split", "zigzag", "--seq-len", "6"], 2,
     "train.seq_len=6: must be divisible by 2*sp = 4 for the zigzag split"),
    (["--sp", "4", "--sp-mode", "ulysses"], 4,
     "parallel.sp=4: ulysses needs model.kv_heads/tp = 2/1 divisible by sp"),
    (["--sp", "8", "--sp-mode", "ulysses"], 8,
     "parallel.sp=8: ulysses needs model.heads/tp = 4/1 divisible by sp"),
    (["--bucket-mb", "0"], 1, "parallel.bucket_mb=0.0: must be > 0"),
    (["--zero", "3"], 1, "parallel.zero=3: ZeRO-2/3 shard over dp x sp, which needs dp*sp > 1 "
                         "(got dp=1, sp=1)"),
    (["--zero", "2", "--tp", "2"], 2, "parallel.zero=2: ZeRO-2/3 shard over dp x sp, which needs"),
    (["--zero", "3", "--zero-prefetch", "-1"], 2, "parallel.zero_prefetch=-1: must be >= 0"),
    (["--zero", "2", "--zero-shared", "node"], 2, "parallel.zero_shared='node' with "
     "parallel.zero=2: node shared memory holds ZeRO-3's parameters (use zero=3)"),
    (["--zero", "3", "--zero-shared", "node", "--device", "cuda"], 2,
     "parallel.zero_shared='node' with train.device='cuda': node shared memory holds host arrays"),
    (["--zero", "2", "--dp-reduce", "hierarchical", "--ranks-per-node", "2"], 4,
     "parallel.dp_reduce='hierarchical' with parallel.zero=2: ZeRO-2/3 reduce-scatter each unit "
     "over the flat dp x sp group"),
    (["--zero", "3", "--grad-compression", "int8"], 2,
     "parallel.grad_compression='int8' with parallel.zero=3: ZeRO-2/3 reduce dense gradients"),
    (["--sp", "3"], 3, "train.seq_len=128: must be divisible by parallel.sp=3"),
    (["--seq-len", "0"], 1, "train.seq_len=0: must be a positive integer"),
    (["--global-batch-size", "6", "--dp", "4"], 4, "train.global_batch_size=6: must be divisible by dp=4"),
    (["--global-batch-size", "16", "--micro-batch-size", "3"], 1,
     "must be divisible by dp*micro_batch_size = 1*3"),
    (["--micro-batch-size", "-1"], 1, "train.micro_batch_size=-1: must be >= 0"),
    (["--steps", "-1"], 1, "train.steps=-1: must be >= 0"),
    (["--lr", "-1"], 1, "train.lr=-1.0: must be >= 0"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], 1, "train.min_lr=0.01: must be in [0, lr=0.001]"),
    (["--warmup-steps", "-2"], 1, "train.warmup_steps=-2: must be >= 0"),
    (["--weight-decay", "-0.1"], 1, "train.weight_decay=-0.1: must be >= 0"),
    (["--beta1", "1"], 1, "train.beta1=1.0: must be in [0, 1)"),
    (["--beta2", "1.5"], 1, "train.beta2=1.5: must be in [0, 1)"),
    (["--eps", "0"], 1, "train.eps=0.0: must be > 0"),
    (["--log-every", "-1"], 1, "train.log_every=-1: must be >= 0"),
    (["--backend", "cupy"], 1, "train.backend='cupy' with train.device='cpu': the CuPy kernels "
                               "need device arrays"),
    (["--reduce-dtype", "bfloat16"], 1, "parallel.reduce_dtype='bfloat16' with "
     "train.dtype='float32': a bf16 gradient reduction is part of mixed precision"),
    (["--dtype", "bfloat16", "--reduce-dtype", "bfloat16", "--dp", "2", "--grad-compression",
      "int8"], 2, "parallel.reduce_dtype='bfloat16' with parallel.grad_compression='int8'"),
    (["--save-every", "-1"], 1, "train.save_every=-1: must be >= 0"),
    (["--keep-last", "-1"], 1, "train.keep_last=-1: must be >= 0"),
    (["--collective-timeout", "-1"], 1, "train.collective_timeout=-1.0: must be >= 0"),
    (["--dump-activations", "1,x"], 1, "train.dump_activations='1,x': must be a comma-separated"),
    (["--dump-activations", "0"], 1, "train.dump_activations='0': must be a comma-separated"),
    (["--ranks-per-node", "-1"], 1, "parallel.ranks_per_node=-1: must be >= 0"),
    (["--ranks-per-node", "3"], 8, "parallel.ranks_per_node=3: must divide the world size 8"),
    (["--dp-reduce", "hierarchical", "--ranks-per-node", "4", "--tp", "3", "--heads", "6",
      "--kv-heads", "3", "--hidden", "96", "--ffn-hidden", "96"], 12,
     "parallel.dp_reduce='hierarchical' with ranks_per_node=4: the nodes (3 nodes x 4 ranks "
     "(--ranks-per-node)) hold [1, 2] ranks of one dp x sp group"),
    (["--topk-ratio", "0"], 1, "parallel.topk_ratio=0.0: must be in (0, 1]"),
    (["--compression-warmup", "5"], 1, "parallel.compression_warmup=5: only with "
     "--grad-compression int8 or topk"),
    (["--grad-compression", "topk", "--compression-warmup", "-2"], 1,
     "parallel.compression_warmup=-2: must be >= 0 (or -1: the codec's default share of the "
     "steps)"),
    (["--allreduce-algorithm", "ring", "--allreduce-hardware", "hw.json"], 1,
     "parallel.allreduce_hardware='hw.json': only with --allreduce-algorithm auto (not 'ring')"),
    (["--allreduce-hardware", "/nonexistent/hw.json"], 1,
     "parallel.allreduce_hardware='/nonexistent/hw.json': no such file"),
    (["--tie-embeddings", "--pp", "2", "--dp", "2", "--grad-compression", "int8"], 4,
     "parallel.grad_compression='int8' with error feedback: not with model.tie_embeddings and "
     "pp=2"),
    (["--ulysses-size", "2"], 1, "parallel.ulysses_size=2: needs --sp-mode hybrid"),
    (["--sp", "4", "--sp-mode", "hybrid"], 4,
     "parallel.ulysses_size=0: --sp-mode hybrid needs a Ulysses group size that divides "
     "parallel.sp=4"),
    (["--sp", "4", "--sp-mode", "hybrid", "--ulysses-size", "3"], 4,
     "parallel.ulysses_size=3: --sp-mode hybrid needs a Ulysses group size that divides"),
    (["--sp", "4", "--sp-mode", "hybrid", "--ulysses-size", "4"], 4,
     "parallel.ulysses_size=4: hybrid needs model.kv_heads/tp = 2/1 divisible by ulysses_size"),
    # accepted but wrong (non-finite floats), and tracebacks before
    (["--lr", "inf"], 1, "train.lr=inf: must be a finite number"),
    (["--init-std", "inf"], 1, "model.init_std=inf: must be a finite number"),
    (["--weight-decay", "inf"], 1, "train.weight_decay=inf: must be a finite number"),
    (["--eps", "inf"], 1, "train.eps=inf: must be a finite number"),
    (["--norm-eps", "inf"], 1, "model.norm_eps=inf: must be a finite number"),
    (["--rope-theta", "inf"], 1, "model.rope_theta=inf: must be a finite number"),
    (["--clip-grad", "nan"], 1, "train.clip_grad=nan: must be a finite number"),
    (["--bucket-mb", "inf"], 1, "parallel.bucket_mb=inf: must be a finite number"),
    (["--collective-timeout", "nan"], 1, "train.collective_timeout=nan: must be a finite number"),
    (["--seed", "-1"], 1, "train.seed=-1: must be >= 0"),
    # the layer-set grammar, one rule for every layer-set field
    (["--window-layers", "1,,2"], 1, "model.window_layers='1,,2': must be all, even, odd or a "
     "comma list of layer indices in [0, 4)"),
    (["--moe-experts", "2", "--moe-layers", "4"], 1, "model.moe_layers='4': must be all, even, "
     "odd or a comma list of layer indices in [0, 4)"),
    (["--moe-experts", "2", "--moe-layers", ""], 1, "model.moe_layers='': must be all, even, odd"),
    (["--steps", str(2**63)], 1, f"train.steps={2**63}: must lie in (-2**63, 2**63)"),
]


@pytest.mark.parametrize("flags,world,message", RULES, ids=[r[2][:40] for r in RULES])
def test_each_rule_exits_2_with_message(flags, world, message, capsys):
    with pytest.raises(SystemExit) as exc:
        resolve_config(flags, world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize("text,n,members", [("all", 5, [0, 1, 2, 3, 4]), ("even", 5, [0, 2, 4]),
                                            ("odd", 5, [1, 3]), (" 3, 0 ", 5, [0, 3])])
def test_a_layer_set_is_parsed_once_and_asked(text, n, members):
    """The layer grammar of --window-layers and --moe-layers: :meth:`LayerSet.contains` names
    the blocks, :meth:`LayerSet.count` counts any range of them without a walk."""
    layers = LayerSet.parse(text, "moe_layers", n)
    assert layers.layers(n) == members and layers.every_layer == (text == "all")
    for start in range(n + 1):
        for stop in range(start, n + 1):
            assert layers.count(start, stop) == sum(start <= i < stop for i in members)
    assert LayerSet.parse("odd", "moe_layers", 10 ** 8).count(0, 10 ** 8) == 5 * 10 ** 7


@pytest.mark.parametrize("text", ["", "x", "5", "-1", "1,,2", "1.0", "\u00b2"])
def test_a_bad_layer_set_names_the_field_the_value_and_the_rule(text):
    with pytest.raises(ConfigError) as exc:
        LayerSet.parse(text, "window_layers", 5)
    assert str(exc.value) == (f"model.window_layers={text!r}: must be all, even, odd or a comma "
                              f"list of layer indices in [0, 5)")


def test_valid_layouts_resolve():
    cfg = resolve_config(["--tp", "2", "--pp", "2"], 8)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp) == (2, 2, 2, 1)
    assert cfg.train.micro_batch_size == 8 and cfg.model.head_dim == 32
    assert cfg.model.ffn_hidden == 352  # 8/3*128 = 341.3 rounded up to a multiple of 32


def test_toml_and_flag_override(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nhidden = 64\nheads = 2\nkv_heads = 1\n[train]\nlr = 0.01\n'
                    'lr_schedule = "constant"\n')
    cfg = resolve_config(["--config", str(path), "--lr", "0.02"], 1)
    assert cfg.model.hidden == 64 and cfg.model.heads == 2 and cfg.train.lr == 0.02
    assert cfg.train.lr_schedule == "constant"
    # The resolved config written to config.toml reads back to the same values.
    again = Config.from_dict(__import__("tomllib").loads(cfg.to_toml()))
    assert again == cfg.config


@pytest.mark.parametrize("text,message", [
    ('[train]\nlr_schedule = "linear"\n', "train.lr_schedule='linear': must be one of constant, cosine"),
    ('[train]\nlrr = 1\n', "train.lrr: unknown field"),
    ('[optim]\nlr = 1\n', "unknown table [optim]"),
    ('[model]\nhidden = "big"\n', "model.hidden='big': must be an integer"),
    ('[train]\nshuffle = 1\n', "train.shuffle=1: must be true or false"),
    ('[parallel]\nzero = 4\n', "parallel.zero=4: must be one of 0, 1, 2, 3"),
    ('[model]\nrope_type = ""\nrope_factor = 0.0\n', "model.rope_type='': must be one of default"),
    ('[model\n', "not valid TOML"),
    ("[train]\nlr = 1" + "0" * 400 + "\n", "too large for a floating-point number"),
])
def test_toml_errors(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        resolve_config(["--config", str(path)], 1)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit) as exc:
        resolve_config(["--config", "/nonexistent/c.toml"], 1)
    assert exc.value.code == 2 and "file not found" in capsys.readouterr().err


def test_unreadable_config_files_exit_2_naming_the_file(tmp_path, capsys):
    """A binary file and a directory given as --config are errors, not
    tracebacks."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\x00\xff\xfe\x80 not text")
    for path, message in ((binary, f"--config {binary}: not valid TOML"),
                          (tmp_path, f"--config {tmp_path}: cannot be read (Is a directory)")):
        with pytest.raises(SystemExit) as exc:
            resolve_config(["--config", str(path)], 1)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_the_configuration_page_table_is_current():
    """docs/configuration.md's table of every field is generated from the field metadata: the
    table under its "Every field" heading is exactly describe_fields()."""
    from pathlib import Path

    from mpipar.config.cli import describe_fields

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = page.split("\n## Every field\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == describe_fields(), (
        "docs/configuration.md's field table is stale: replace it with the output of "
        "python -c 'from mpipar.config.cli import describe_fields; print(describe_fields())'")


def test_rope_scalings_are_the_kernels():
    """Each ``model.rope_type`` resolves to the scaling whose fields its rules read, and the
    names are the frequency rules the kernels compute."""
    from mpipar.kernels.rope_frequencies import ROPE_SCALINGS
    from mpipar.model.rope import ROPE_TYPES, RopeScaling
    assert ROPE_TYPES == ROPE_SCALINGS
    flags = {n: [k for k in ("scales", "pretraining_context", "frequency_band",
                             "by_sequence_length", "correction_range")
                 if getattr(ModelConfig(rope_type=n).rope, k)]
             for n in ROPE_TYPES}
    assert flags == {"default": [], "linear": ["scales"],
                     "dynamic": ["scales", "pretraining_context", "by_sequence_length"],
                     "llama3": ["scales", "pretraining_context", "frequency_band"],
                     "yarn": ["scales", "pretraining_context", "correction_range"]}
    with pytest.raises(ValueError, match="rope_type='ntk': must be one of default, linear"):
        RopeScaling.named("ntk")
