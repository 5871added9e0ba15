"""Trains a process reward model on step labels (`rlscale.reward_models.prm`):

    python -m rlscale.main.train_prm --labels labels.jsonl --out PRM_DIR \\
        [--init WORKDIR/final | --model tiny --tokenizer PATH] \\
        [--heldout FILE | --heldout_frac 0.1] [--label soft --steps N --lr LR]

reads the rows `python -m rlscale.main.label_steps` writes, holds out `--heldout_frac` of the
prompts unless given `--heldout` rows, trains, saves the PRM for `python -m
rlscale.main.evaluate --scorer prm --prm DIR` and `reward.prm=DIR`, and prints its held-out
step accuracy. See docs/preference_and_reward_models.md.
"""

from absl import flags

from rlscale import cli
from rlscale.main import head_flags
from rlscale.reward_models import prm, step_labels

_INTS = ("batch_rows", "max_steps", "eval_every", "seed", "warmup_steps")


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv  # No config file.
    flags.DEFINE_string("labels", None, "Labels file (label_steps' rows).", flag_values=fv)
    flags.DEFINE_string("heldout", None, "Held-out labels file.", flag_values=fv)
    flags.DEFINE_float(
        "heldout_frac",
        0.1,
        "Share of the prompts held out when no --heldout is given.",
        flag_values=fv,
    )
    flags.DEFINE_enum("label", "soft", step_labels.LABEL_FIELDS, "Labels to fit.", flag_values=fv)
    flags.DEFINE_string(
        "delimiter", None, "What ends a step; default: the rows' own.", flag_values=fv
    )
    flags.DEFINE_integer(
        "seq_len",
        None,
        "The bucket: prompt + completion ids (default: the longest row, rounded up to 16).",
        flag_values=fv,
    )
    head_flags.define(fv, prm.PRMConfig(), _INTS)
    flags.mark_flag_as_required("labels", flag_values=fv)


def main(fv: flags.FlagValues) -> dict:
    if fv.heldout and fv["heldout_frac"].present:
        raise ValueError(f"--heldout={fv.heldout} and --heldout_frac={fv.heldout_frac}: give one")
    examples, delimiter = step_labels.read_labels(fv.labels, label=fv.label, delimiter=fv.delimiter)
    if fv.heldout:
        heldout, _ = step_labels.read_labels(fv.heldout, label=fv.label, delimiter=delimiter)
    else:
        examples, heldout = step_labels.split_heldout(examples, fv.heldout_frac, fv.seed)
    tok, model = head_flags.start(fv)
    seq_len = fv.seq_len or prm.row_bucket([*examples, *heldout], tok)
    cfg = prm.PRMConfig(
        delimiter=delimiter,
        seq_len=seq_len,
        **head_flags.settings(fv, (*_INTS, "lr", "weight_decay")),
    )
    return head_flags.train_and_save(
        fv,
        prm,
        examples,
        heldout,
        tok,
        cfg,
        model,
        kind="process reward model",
        rows_name="completions",
        metric="step accuracy",
    )


if __name__ == "__main__":
    cli.run_command(define_flags, main)
