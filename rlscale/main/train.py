"""Trains: `python -m rlscale.main --config configs/X.py[:variant] --workdir DIR` (also
`python -m rlscale.main.train`).

Runs the RL loop (`rlscale.rl.run`) or the sampling demo (`recipe="demo"`), after joining a
multi-process job when the environment describes one (`rlscale.distributed`); after an RL run
it fits the run's scaling curve (`scaling.fit_run`: WORKDIR/scaling/). `--config.a.b=value`
overrides a field; `--verbosity=1` adds the libraries' INFO logs and the config.
"""

import os
import sys

import jax
from absl import flags, logging

from rlscale import cli, console, distributed, rl, scaling
from rlscale.sampling import demo


def define_flags(fv: flags.FlagValues, argv) -> None:
    cli.define_config(fv, argv)
    flags.DEFINE_string(
        "workdir", None, "Directory for outputs (metrics, checkpoints).", flag_values=fv
    )
    flags.DEFINE_bool(
        "allow_config_change",
        False,
        "Resume a workdir's checkpoint even though the config differs from the saved one.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "compilation_cache",
        os.path.join(os.path.expanduser("~"), ".cache", "rlscale", "jax"),
        "JAX's persistent compilation cache: a run loads the programs an earlier run on this "
        "machine compiled instead of compiling them again ('' turns it off; "
        "JAX_COMPILATION_CACHE_DIR, when set, takes precedence).",
        flag_values=fv,
    )
    flags.mark_flag_as_required("workdir", flag_values=fv)


def main(fv: flags.FlagValues) -> dict | None:
    distributed.use_compilation_cache(fv.compilation_cache)
    distributed.maybe_initialize_distributed()
    config, workdir = fv.config, fv.workdir
    cli.make_dir(workdir, "--workdir")
    if console.verbosity() > 0:
        logging.info("config:\n%s", config)
    if config.recipe == "demo":
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2, sort_keys=True))
        demo.run(config, workdir)
        return None
    run = rl.resolve(config)  # The ConfigDict stops here: typed sections, every problem at once.
    try:
        summary = rl.run(run, workdir, allow_config_change=fv.allow_config_change)
    except rl.PreemptedError as e:
        print(f"\n{e}", file=sys.stderr)
        sys.exit(143)
    cli.print_summary("rlscale run finished", summary, width=28)
    if jax.process_index() == 0:
        print("  " + scaling.describe(scaling.fit_run(workdir)))
    return summary


if __name__ == "__main__":
    cli.run_command(define_flags, main)
