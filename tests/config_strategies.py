"""Hypothesis strategies for configurations, shared by the fuzzing tests in process and the
launched ones: a small valid configuration with a few fields set to drawn values (non-finite and
extreme ones included, now and then one of the wrong type), and what a run does with one before
it allocates anything."""
from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from mpipar.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from mpipar.rules import validate

BASE = {"model": {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2},
        "train": {"seq_len": 16, "global_batch_size": 4, "steps": 1, "backend": "numpy",
                  "log_every": 0}}
"""A small configuration that validates on 1, 2 and 4 ranks."""

PATHS = {"data", "eval_data", "run_dir", "save_dir", "init_from_hf", "export_hf",
         "allreduce_hardware", "init_adapter", "export_adapter"}
"""Fields naming files: their rules are the file checks of other tests, not validation's."""

INTS = st.one_of(st.integers(-3, 70), st.sampled_from(
    [0, 1, 2**31, 2**53, 2**63 - 1, 2**63, -2**63, 10**30]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0.0, -0.0, 5e-324, 1e-300, 1e-8, 0.5, 1.0, 1e300, -1.0]))
STRINGS = {"dump_activations": st.sampled_from(["", "1", "1,2", "0", "x", "1,,2", " 3 "]),
           "resume": st.sampled_from(["", "auto"]), "tensorboard": st.sampled_from(["", "off"]),
           "trace_steps": st.sampled_from(["", "2", "1-3", "2,4-5", "0", "x", "3-1", "1,,2"]),
           "window_layers": st.sampled_from(["all", "even", "odd", "0,2", "", "x", "9", "1,,2"]),
           "moe_layers": st.sampled_from(["all", "even", "odd", "0,1", "", "x", "9", "1,,2"]),
           "lora_targets": st.sampled_from(["q_proj,v_proj", "down_proj", "", "x", "q_proj,q_proj",
                                            "q_proj,,v_proj", "lm_head"])}


def field_values(section: str, f: dataclasses.Field) -> st.SearchStrategy:
    """Values for field ``f``: any of its type (extremes included), its choices and a few
    that are not, and now and then a value of the wrong type."""
    kind = str(f.type)
    if f.metadata.get("choices"):
        choices = list(f.metadata["choices"])
        base = st.sampled_from(choices + (["", "bogus"] if kind == "str" else [-1, 2]))
    elif kind == "int":
        base = INTS
    elif kind == "float":
        base = FLOATS
    elif kind == "bool":
        base = st.booleans()
    else:
        base = STRINGS[f.name]
    return st.one_of(base, st.just("wrong type")) if kind != "str" else base


FIELDS = [(section, f) for section, cls in (("model", ModelConfig), ("parallel", ParallelConfig),
                                             ("train", TrainConfig))
          for f in dataclasses.fields(cls) if f.name not in PATHS]


@st.composite
def configs(draw, changes: int = 4) -> dict:
    """The TOML tables of :data:`BASE` with 1 to ``changes`` fields set to drawn values."""
    data = {s: dict(v) for s, v in BASE.items()}
    picked = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=changes,
                           unique_by=lambda x: (x[0], x[1].name)))
    for section, f in picked:
        data.setdefault(section, {})[f.name] = draw(field_values(section, f))
    return data


def validation_error(data: dict, world: int) -> str | None:
    """What a run does before it allocates anything, in process: parse the tables, validate
    against ``world``, check rank 0's memory. Returns the error, or None if it may start."""
    from mpipar.plan.admission import check_memory
    try:
        cfg = validate(Config.from_dict(data), world)
        check_memory(cfg, 0, 1)
    except ConfigError as exc:
        return str(exc)
    par = cfg.parallel
    assert par.dp * par.tp * par.pp * par.sp == world
    assert cfg.train.global_batch_size % (par.dp * cfg.train.micro_batch_size) == 0
    assert cfg.model.layers % (par.pp * par.virtual_stages) == 0
    for section in (cfg.model, par, cfg.train):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if str(f.type) == "float":
                assert math.isfinite(value), (f.name, value)
            elif str(f.type) == "int":
                assert -2**63 < value < 2**63, (f.name, value)
    return None
