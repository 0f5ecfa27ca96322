"""Property-based fuzzing of configurations in process: random combinations of fields and values
(:mod:`config_strategies`), non-finite and extreme ones included, either validate or are refused
with a message naming a field, within seconds. Launched runs of such configurations:
e2e/test_config_fuzz.py.

Examples start from a small valid configuration and change a few fields, so that both outcomes
are common; each is validated as a run does before it allocates (validation, then the memory
check). The examples are derandomized so that CI sees the same ones every time; run with
``--hypothesis-seed=N`` (after removing ``derandomize``) to explore others."""
from __future__ import annotations

import re
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config_strategies import configs, validation_error

NAMES_A_FIELD = re.compile(r"\b(model|parallel|train)[.:]|--[a-z][a-z-]+")


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=configs(), world=st.sampled_from([1, 2, 3, 4, 8]))
def test_every_configuration_validates_or_names_a_field(data, world):
    t0 = time.monotonic()
    error = validation_error(data, world)
    assert time.monotonic() - t0 < 5, data
    if error is not None:
        assert NAMES_A_FIELD.search(error), error
