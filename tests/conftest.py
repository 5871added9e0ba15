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


class CompileCounter:
    """Counts XLA backend compilations while active (a jit cache hit compiles nothing)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listener(self, event, duration_secs, **kwargs):
        del duration_secs, kwargs
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


@pytest.fixture
def count_compiles():
    return CompileCounter
