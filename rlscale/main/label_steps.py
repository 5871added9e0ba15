"""Labels a policy's own completions step by step (`rlscale.reward_models.step_labels`):

    python -m rlscale.main.label_steps --config configs/quickstart.py \\
        --checkpoint WORKDIR/final --out labels.jsonl [--split train --n 64 --k 4 \\
        --rollouts 4 --delimiter STR --seed 0] [--config.a.b=value ...]

samples `--k` completions for each of the first `--n` problems of the config's task, labels
each step with `--rollouts` continuations of its prefix and writes one JSON row per
completion (the rows `python -m rlscale.main.train_prm` reads). See
docs/preference_and_reward_models.md.
"""

import os

import jax
from absl import flags

from rlscale import cli, hub, saved_policy
from rlscale.reward_models import step_labels

_INT_FLAGS = {
    "n": (64, "Problems: the first n of the split."),
    "k": (4, "Completions sampled per problem."),
    "rollouts": (4, "Continuations sampled per step prefix."),
    "seed": (0, "Sampling seed."),
    "batch": (32, "Prompts per sampler call."),
}


def define_flags(fv: flags.FlagValues, argv) -> None:
    cli.define_config(fv, argv)
    flags.DEFINE_string("checkpoint", None, "Policy params, e.g. WORKDIR/final.", flag_values=fv)
    flags.DEFINE_string("out", None, "Labels file to write (JSON lines).", flag_values=fv)
    flags.DEFINE_string("split", "train", "Split of the task.", flag_values=fv)
    for name, (default, text) in _INT_FLAGS.items():
        flags.DEFINE_integer(name, default, text, flag_values=fv)
    flags.DEFINE_string(
        "delimiter",
        None,
        "What ends a step (default: the task's, e.g. '=' for arithmetic, else a newline).",
        flag_values=fv,
    )
    flags.DEFINE_string("tokenizer", None, "Tokenizer path (default: the run's).", flag_values=fv)
    flags.DEFINE_string(
        "workdir", None, "Run directory (default: the checkpoint's parent).", flag_values=fv
    )
    flags.mark_flags_as_required(["checkpoint", "out"], flag_values=fv)


def main(fv: flags.FlagValues) -> dict:
    out = os.path.abspath(fv.out)
    if os.path.isdir(out):
        raise ValueError(f"--out={fv.out} is a directory: name the labels file to write")
    cli.make_dir(os.path.dirname(out), "--out")
    checkpoint = hub.local_path(fv.checkpoint, "--checkpoint")  # A Hub name, too.
    if checkpoint != fv.checkpoint and fv.workdir is None:
        raise ValueError(f"--checkpoint={fv.checkpoint} is on the Hugging Face Hub: pass --workdir")
    rows = step_labels.label_policy(
        saved_policy.resolve(fv.config),
        checkpoint,
        split=fv.split,
        delimiter=fv.delimiter,
        tokenizer_path=hub.local_path(fv.tokenizer, "--tokenizer"),
        workdir=fv.workdir,
        **{name: fv[name].value for name in _INT_FLAGS},
    )
    if jax.process_index() == 0:
        step_labels.write_labels(out, rows)
    summary = {**step_labels.label_summary(rows), "out": out}
    cli.print_summary("rlscale process reward labels", summary, quoted=("delimiter",))
    return summary


if __name__ == "__main__":
    cli.run_command(define_flags, main)
