"""Checkpoints of model params in rlscale's own format (orbax), with their model config.

A params checkpoint is a directory holding `model_config.json` (the `ModelConfig` fields) and
an orbax `params/` tree, restored directly onto the target shardings. The RL loop's full train
state (optimizer, data cursor, RNG, ...) builds on the same layout.
"""

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from rlscale import sharding
from rlscale.model import config as model_config
from rlscale.model import decoder


def save_params(path: str, cfg: model_config.ModelConfig, params) -> None:
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), nnx.to_pure_dict(params), force=True)
    if jax.process_index() == 0:
        with open(os.path.join(path, "model_config.json"), "w") as f:
            json.dump(model_config.as_dict(cfg), f, indent=2)


def load_params(path: str, mesh=None, rules: sharding.Rules = sharding.TRAIN_RULES):
    """(cfg, graphdef, params) from `save_params`; on `mesh` with `rules` if given."""
    path = os.path.abspath(path)
    config_path = os.path.join(path, "model_config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} does not exist: not an rlscale params checkpoint")
    with open(config_path) as f:
        cfg = model_config.from_dict(json.load(f))
    graphdef, abstract = decoder.abstract_model(cfg)
    if mesh is None:
        mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    shardings = sharding.param_shardings(abstract, mesh, rules)
    target = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shardings),
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.join(path, "params"), target)
    nnx.replace_by_pure_dict(abstract, restored)
    return cfg, graphdef, abstract
