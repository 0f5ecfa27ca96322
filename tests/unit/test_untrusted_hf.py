"""Hugging Face directories from elsewhere: a config.json with fields of the wrong type or value,
and a weight map that names files outside the directory, are refused with the field or entry
named (exit 2, never a traceback), by ``python -m mpipar.hf``, by ``generate`` and by training's
``--init-from-hf``; a fuzz of config.json never ends in anything but a clean refusal."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from untrusted import run_generate, run_train
from mpipar.checkpoint.huggingface import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, HFCheckpointError,
                                           hf_config, hf_name, load_hf, model_config_from_hf,
                                           save_hf, support)
from mpipar.config import ConfigError, ModelConfig
from mpipar.hf import main as hf_main
from mpipar.layout import resolve_model
from mpipar.model.params import init_params

MODEL = resolve_model(ModelConfig(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2,
                                  ffn_hidden=64))
TRAIN = ["--seq-len", "8", "--global-batch-size", "2", "--steps", "1", "--backend", "numpy",
         "--log-every", "0", "--tensorboard", "off"]


@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face export of :data:`MODEL` (float32) and a token file for training on it."""
    save_hf(tmp_path / "hf", MODEL, init_params(MODEL, 3, np.float32))
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 256, size=(8, 9)))
    return tmp_path / "hf"


def _edit_config(path, **fields) -> None:
    raw = json.loads((path / CONFIG_FILE).read_text())
    raw.update(fields)
    (path / CONFIG_FILE).write_text(json.dumps(raw))


def _sharded(path) -> dict:
    """Split ``path``'s weights over two files listed by an index; returns the weight map."""
    from safetensors.numpy import save_file
    _, params = load_hf(path)
    tensors = {hf_name(n): v for n, v in params.items()}
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / WEIGHTS_FILE).unlink()
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


BAD_CONFIGS = [
    (dict(model_type={"x": 1}), "model_type={'x': 1} is not supported"),
    (dict(rope_theta="abc"), "rope_theta='abc' must be a positive number"),
    (dict(rope_theta=[1]), "rope_theta=[1] must be a positive number"),
    (dict(model_type="gemma", rope_scaling={"rope_type": "dynamic", "factor": 2.0},
          max_position_embeddings=None), "model_type='gemma' is not supported"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], layer_types=5),
     "layer_types=5 must be a list of strings"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings='yes' must be true or false"),
    (dict(num_hidden_layers=10**400), "num_hidden_layers=1000"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps=inf must be a positive number"),
]


@pytest.mark.parametrize("fields,message", BAD_CONFIGS,
                         ids=[repr(sorted(f))[:40] for f, _ in BAD_CONFIGS])
def test_a_badly_typed_config_is_refused_by_hf_inspect_and_generate(hf_dir, capsys, fields,
                                                                    message):
    """Each of these badly typed configs is handled without a traceback: ``inspect`` reports the
    field as not supported (its status 1 for an unusable checkpoint), ``convert`` and
    ``generate`` exit 2 naming it."""
    _edit_config(hf_dir, **fields)
    assert hf_main(["inspect", str(hf_dir)]) == 1
    out = capsys.readouterr().out
    assert message in out and "NOT SUPPORTED" in out
    assert hf_main(["convert", str(hf_dir), str(hf_dir.parent / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert not (hf_dir.parent / "out").exists()
    code, err = run_generate([str(hf_dir), "--prompt", "x"])
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_badly_typed_config_stops_init_from_hf_before_anything_is_written(hf_dir, tmp_path):
    _edit_config(hf_dir, rope_theta="abc")
    code, err = run_train([*TRAIN, "--data", str(tmp_path / "data.npy"), "--init-from-hf",
                           str(hf_dir), "--run-dir", str(tmp_path / "run")])
    assert code == 2 and err.count("rope_theta='abc' must be a positive number") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry,message", [
    ("/etc/passwd", "points outside the model directory"),
    ("../secret.safetensors", "points outside the model directory"),
    ("sub/../../x.safetensors", "points outside the model directory"),
    (7, "must be the name of a safetensors file"),
    (None, "must be the name of a safetensors file"),
])
def test_a_weight_map_entry_outside_the_directory_is_refused(hf_dir, tmp_path, capsys, entry,
                                                             message):
    """Weight map entries with absolute or ``../`` paths (a file outside the directory read as
    weights) and non-string entries are refused naming the entry, before any tensor is read."""
    weight_map = _sharded(hf_dir)
    first = sorted(weight_map)[0]
    (tmp_path / "secret.safetensors").write_bytes((hf_dir / weight_map[first]).read_bytes())
    weight_map[first] = entry
    (hf_dir / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    assert hf_main(["convert", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"weight_map[{first!r}] = {entry!r}" in err and message in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
    assert hf_main(["inspect", str(hf_dir)]) == 2
    assert message in capsys.readouterr().err
    code, err = run_generate([str(hf_dir), "--prompt", "x"])
    assert code == 2 and message in err and err.count("\n") == 1, err


# ----------------------------------------------------------------------------------- fuzz
BASE = hf_config(MODEL, "float32")
FIELDS = sorted(BASE) + ["rope_scaling", "layer_types", "use_sliding_window", "sliding_window",
                         "mlp_bias", "partial_rotary_factor", "original_max_position_embeddings",
                         "hidden_act"]
SCALING = ["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
           "original_max_position_embeddings", "rope_theta", "partial_rotary_factor"]
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 70),
              st.sampled_from([0, 2**31, 2**63, 10**400, -1]),
              st.floats(allow_nan=True, allow_infinity=True),
              st.sampled_from(["", "llama", "qwen2", "mistral", "gemma", "silu", "gelu",
                               "default", "linear", "dynamic", "llama3", "yarn",
                               "full_attention", "sliding_attention", "abc"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(SCALING), inner, max_size=4)),
    max_leaves=6)


@st.composite
def hf_configs(draw) -> dict:
    """:data:`BASE` with 1 to 4 fields deleted or set to any JSON value (RoPE scaling objects
    with fields of any value among them)."""
    raw = json.loads(json.dumps(BASE))
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        if draw(st.booleans()) and name in raw:
            del raw[name]
        elif name in ("rope_scaling", "rope_parameters") and draw(st.booleans()):
            raw[name] = draw(st.dictionaries(st.sampled_from(SCALING), JSON, max_size=5))
        else:
            raw[name] = draw(JSON)
    return raw


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(raw=hf_configs())
def test_fuzzed_configs_are_read_or_refused_naming_a_field(raw):
    """Any config.json is either read into a model config whose numbers are finite or refused
    with an HFCheckpointError: no other exception, whatever the fields hold."""
    found, _ = support(raw)
    assert all(isinstance(a.reading, str) and isinstance(a.problem, str) for a in found)
    try:
        cfg = model_config_from_hf(raw)
    except HFCheckpointError as exc:
        assert str(exc).startswith(CONFIG_FILE)
        return
    except ConfigError as exc:  # the model config's own rules, naming a model field
        assert "model." in str(exc), exc
        return
    for name in ("rope_theta", "norm_eps", "init_std", "rope_factor"):
        assert math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0, (name, cfg)


def test_hf_inspect_names_an_index_entry_its_shard_lacks(hf_dir, capsys):
    """The index maps a tensor to the other shard: ``inspect`` exits 2 naming the entry and the
    shard (it printed a traceback)."""
    weight_map = _sharded(hf_dir)
    name = sorted(weight_map)[0]
    other = next(f for f in set(weight_map.values()) if f != weight_map[name])
    (hf_dir / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map, name: other}}))
    assert hf_main(["inspect", str(hf_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"maps {name} to {other}, which does not hold it" in err


@pytest.mark.parametrize("entries,message", [
    (300_000, "'weight_map' must map tensor names to files (at most 262,144)"),
    (2_000_000, "model.safetensors.index.json: larger than 67108864 bytes")])
def test_an_index_of_huge_numbers_of_entries_is_refused_at_once(hf_dir, capsys, entries,
                                                                 message):
    import time
    weight_map = _sharded(hf_dir)
    junk = {f"junk.{k}": f"junk-{k}.safetensors" for k in range(entries)}
    (hf_dir / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map, **junk}}))
    start = time.monotonic()
    assert hf_main(["inspect", str(hf_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert time.monotonic() - start < 30 and len(err.splitlines()) == 1
