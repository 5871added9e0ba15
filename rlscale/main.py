"""Entry point: `python -m rlscale.main --config configs/X.py[:variant] --workdir DIR`.

The config is an ml_collections file, locked so a mistyped key is an error naming it; override
any field with `--config.a.b=value`. Today it runs the sampling demo (`rlscale.demo`).
"""

import os

import jax
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with a :variant suffix.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for outputs (metrics, checkpoints).")
flags.mark_flags_as_required(["config", "workdir"])


def maybe_initialize_distributed():
    """Joins the multi-host job when launched on a pod (the launcher sets the coordinator)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("TPU_WORKER_HOSTNAMES"):
        jax.distributed.initialize()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    maybe_initialize_distributed()
    config, workdir = _CONFIG.value, _WORKDIR.value
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    logging.info("config:\n%s", config)
    from rlscale import demo

    demo.run(config, workdir)


if __name__ == "__main__":
    app.run(main)
