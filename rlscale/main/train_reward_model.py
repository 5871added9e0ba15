"""Trains a Bradley-Terry reward model on preference pairs
(`rlscale.reward_models.bradley_terry`):

    python -m rlscale.main.train_reward_model --pairs train.jsonl --heldout test.jsonl \\
        --out DIR [--init POLICY_DIR | --model tiny --tokenizer PATH] [--steps N]

reads prompt/chosen/rejected rows (`rlscale.data.preferences`), trains, saves the reward model
for `python -m rlscale.main.evaluate --scorer reward_model` and `reward.model=DIR`, and
prints its held-out pair accuracy. See docs/preference_and_reward_models.md.
"""

from absl import flags

from rlscale import cli
from rlscale.data import preferences
from rlscale.main import head_flags
from rlscale.reward_models import bradley_terry

_INTS = ("seq_len", "batch_pairs", "eval_every", "seed", "warmup_steps")
_FIELDS = ("prompt_field", "chosen_field", "rejected_field")


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv  # No config file.
    flags.DEFINE_string(
        "pairs", None, "Training pairs (prompt/chosen/rejected rows).", flag_values=fv
    )
    flags.DEFINE_string(
        "heldout", None, "Held-out pairs: accuracy is measured on them.", flag_values=fv
    )
    for name in _FIELDS:
        flags.DEFINE_string(name, name.split("_")[0], "Field of a row.", flag_values=fv)
    head_flags.define(fv, bradley_terry.RMConfig(), _INTS)
    flags.mark_flag_as_required("pairs", flag_values=fv)


def main(fv: flags.FlagValues) -> dict:
    cfg = bradley_terry.RMConfig(**head_flags.settings(fv, (*_INTS, "lr", "weight_decay")))
    tok, model = head_flags.start(fv)
    fields = head_flags.settings(fv, _FIELDS)
    pairs = preferences.read_pairs(fv.pairs, **fields)
    heldout = preferences.read_pairs(fv.heldout, **fields) if fv.heldout else []
    return head_flags.train_and_save(
        fv,
        bradley_terry,
        pairs,
        heldout,
        tok,
        cfg,
        model,
        kind="reward model",
        rows_name="pairs",
        metric="accuracy",
    )


if __name__ == "__main__":
    cli.run_command(define_flags, main)
