"""Test setup: eight CPU devices, so sharding tests can build a 2x2x2 mesh."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def tiny_cfg():
    from rlscale import model

    return model.get("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
    from rlscale import model

    params = model.init_params(tiny_cfg, jax.random.key(0))
    graphdef, _ = model.abstract_model(tiny_cfg)
    return graphdef, params
