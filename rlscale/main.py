"""Entry point: `python -m rlscale.main --config configs/X.py[:variant] --workdir DIR`.

The config is an ml_collections file, locked so a mistyped key is an error naming it; override
any field with `--config.a.b=value`. Today it runs the sampling demo (`rlscale.demo`).
After an RL run it fits the run's scaling curve (`scaling.fit_run`: `WORKDIR/scaling/`).
"""

import os
import re
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with a :variant suffix.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for outputs (metrics, checkpoints).")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "Resume a workdir's checkpoint even though the config differs from the saved one.",
)
flags.mark_flags_as_required(["config", "workdir"])


def parse_flags(argv):
    """absl flag parsing, with bad config keys and values reported in one line, not a traceback.

    ml_collections applies `--config.a.b=v` overrides while parsing, and a key the locked
    config does not have raises deep inside it; the message it carries names the key.
    """
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"error: {e}\nPass --helpshort to see the flags.")
    except (AttributeError, KeyError) as e:
        # A key the locked config lacks; ml_collections' message quotes it (repr, nested).
        bad = " ".join(a for a in argv[1:] if a.startswith("--config."))
        key = re.search(r"'([^'\\]+)", str(e))
        hint = re.search(r'Did you mean "[^"]+"', str(e))
        sys.exit(
            f"error: {bad}: no such config key {key.group(1) if key else str(e)!r}"
            + (f"; {hint.group(0).lower()}?" if hint else "")
        )


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
    logging.info("config:\n%s", config)
    if config.recipe == "demo":
        from rlscale import demo

        if jax.process_index() == 0:
            with open(os.path.join(workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2, sort_keys=True))
        demo.run(config, workdir)
        return
    from rlscale import rl

    try:
        summary = rl.run(config, workdir, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
    except rl.PreemptedError as e:
        print(f"\n{e}", file=sys.stderr)
        sys.exit(143)
    except ValueError as e:  # Bad config or input: the message names it; no traceback.
        sys.exit(f"error: {e}")
    print("\nrlscale run finished")
    for k, v in summary.items():
        print(f"  {k:<28} {v:.4g}" if isinstance(v, float) else f"  {k:<28} {v}")
    if jax.process_index() == 0:
        from rlscale import scaling

        print("  " + scaling.describe(scaling.fit_run(workdir)))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
