"""Checks that the RL loop learns when the signal is easy: a trivial reward on the quickstart.

    python tools/rl_sanity.py --workdir /tmp/rl_sanity --config.steps=30 \\
        --config.optim.lr=1e-4 --config.eval.every=10 [--warm_from QUICKSTART_WORKDIR]

Runs `--config` (default `configs/quickstart.py`; `:variant` suffixes and `--config.a.b=v`
overrides as for `rlscale.main`) with the task's verifier replaced by `starts_with_one` ("the
completion starts with the digit 1": `reward.fn=rl_sanity:starts_with_one`, scored in the
run's reward worker pool like any verifier) and prints one JSON line with the held-out rate
before and after: `{"start": ..., "end": ...}`. Measured on a 2-core CPU with the command above
(seed 0, warm start reused from a quickstart workdir via --warm_from): 0.29 -> 0.56. If this
stays flat, the loop is broken; if it rises while the quickstart's own task does not, the
task's signal is what limits RL. `--config configs/quickstart.py:smoke --config.steps=2` runs
it end to end in about a minute (the test), which says nothing about learning.

Only the standard library is imported at the top: the reward workers import this file (as
the module `rl_sanity`, from this directory on their `sys.path`) for `starts_with_one`.
"""

import json
import os
import shutil
import sys

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS_DIR)
REWARD_FN = "rl_sanity:starts_with_one"


def starts_with_one(completion, problem) -> float:
    """1 if the completion starts with the digit 1 (after whitespace), else 0."""
    del problem
    return float(completion.strip().startswith("1"))


def define_flags(fv, argv) -> None:
    from absl import flags

    from rlscale import cli

    cli.define_config(fv, argv, default=os.path.join(ROOT, "configs", "quickstart.py"))
    flags.DEFINE_string("workdir", None, "Directory for the run's outputs.", flag_values=fv)
    flags.DEFINE_string(
        "warm_from",
        None,
        "A quickstart workdir whose data, tokenizer and SFT warm start to reuse.",
        flag_values=fv,
    )
    flags.mark_flag_as_required("workdir", flag_values=fv)


def main(fv) -> None:
    from rlscale import cli, rl

    # The reward workers fork from a server started with this process's sys.path; running as
    # `python tools/rl_sanity.py` puts this directory first, but say so rather than rely on it.
    if TOOLS_DIR not in sys.path:
        sys.path.insert(0, TOOLS_DIR)
    cfg = fv.config
    cfg.reward.fn = REWARD_FN
    cli.make_dir(fv.workdir, "--workdir")
    if fv.warm_from:
        for name in ("sft", "data", "tokenizer.model"):
            src, dst = os.path.join(fv.warm_from, name), os.path.join(fv.workdir, name)
            if not os.path.exists(dst):
                (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    summary = rl.run(rl.resolve(cfg), fv.workdir)
    print(json.dumps({"start": summary["start/eval_pass@1"], "end": summary["end/eval_pass@1"]}))


if __name__ == "__main__":
    from rlscale import cli

    cli.run_command(define_flags, main)
