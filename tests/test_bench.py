"""`tools/bench.py`: one invocation runs its sections in turn on the same params."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from rlscale import model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "tools", "bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_section_leaves_the_params_to_the_sections_after_it():
    """The train step donates its state; the params the generator section reads after it
    must still hold their values (a deleted buffer raises on the read)."""
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    before = jax.tree.map(np.array, params)
    _bench().bench_train(cfg, params, graphdef, 2, 16, peak=1.0, repeats=1)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before)
