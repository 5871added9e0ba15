"""Checks that the RL loop learns when the signal is easy: a trivial reward on the quickstart.

    python tools/rl_sanity.py --workdir /tmp/rl_sanity [--steps 30] [--lr 1e-4]

Runs `configs/quickstart.py` with the task's verifier replaced by "the completion starts with
the digit 1" and prints the held-out rate before and after. Measured on a 2-core CPU (seed 0,
lr 1e-4, 30 steps, warm start reused from a quickstart workdir via --warm_from): 0.29 -> 0.56.
If this stays flat, the loop is broken; if it rises while the quickstart's own task does not,
the task's signal is what limits RL.
"""

import argparse
import importlib.util
import json
import os
import shutil

from rlscale import rl
from rlscale.data import tasks


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--warm_from",
        default=None,
        help="a quickstart workdir whose data, tokenizer and SFT warm start to reuse",
    )
    args = p.parse_args()

    original = tasks.get

    def trivial_task(name, difficulty, seed=0):
        task = original(name, difficulty, seed)
        task.verify = lambda text, problem: float(text.strip().startswith("1"))
        return task

    rl.tasks.get = trivial_task
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "quickstart", os.path.join(root, "configs", "quickstart.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.steps, config.optim.lr, config.eval.every = args.steps, args.lr, 10
    os.makedirs(args.workdir, exist_ok=True)
    if args.warm_from:
        for name in ("sft", "data", "tokenizer.model"):
            src, dst = os.path.join(args.warm_from, name), os.path.join(args.workdir, name)
            if not os.path.exists(dst):
                (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    summary = rl.run(config, args.workdir)
    print(json.dumps({"start": summary["start/eval_pass@1"], "end": summary["end/eval_pass@1"]}))


if __name__ == "__main__":
    main()
