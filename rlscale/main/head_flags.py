"""The flags the two scalar-head training commands share (`train_prm`,
`train_reward_model`): where the head starts, its tokenizer, the output directory, the steps
and the `TrainSettings` fields a command exposes."""

import os

from absl import flags

from rlscale import cli, hub, saved_policy
from rlscale import model as model_lib
from rlscale import tokenizers as tokenizer_lib
from rlscale.reward_models import scalar_head


def define(fv: flags.FlagValues, defaults, ints: tuple, floats: tuple = ("lr", "weight_decay")):
    """--out, --init | --model, --tokenizer, --steps, and the `defaults` (a `TrainSettings`)
    fields named in `ints` and `floats`, each defaulting to its value there."""
    flags.DEFINE_string("out", None, "Directory to write the model to.", flag_values=fv)
    flags.DEFINE_string("init", None, "Policy checkpoint to start from.", flag_values=fv)
    flags.DEFINE_string(
        "model", "tiny", "Named architecture from scratch (without --init).", flag_values=fv
    )
    flags.DEFINE_string(
        "tokenizer",
        None,
        "Tokenizer path (tokenizers.load); default: the --init checkpoint's own, else its "
        "run's WORKDIR/tokenizer.model.",
        flag_values=fv,
    )
    flags.DEFINE_integer("steps", 200, "Optimizer steps.", flag_values=fv)
    for name in ints:
        flags.DEFINE_integer(
            name, getattr(defaults, name), f"See {type(defaults).__name__}.", flag_values=fv
        )
    for name in floats:
        flags.DEFINE_float(
            name, getattr(defaults, name), f"See {type(defaults).__name__}.", flag_values=fv
        )
    flags.mark_flag_as_required("out", flag_values=fv)


def start(fv: flags.FlagValues):
    """(tokenizer, model): the tokenizer (`--tokenizer`, else the policy's) and what the head
    starts from (`--init`'s directory, else `--model`'s `ModelConfig`). Either may be a
    Hugging Face Hub name (`hub`).

    Raises:
      ValueError: Naming --init when it is no directory or given with --model, and
        --tokenizer when there is none to default to.
    """
    if fv.init is not None and fv["model"].present:
        raise ValueError(f"--init={fv.init} and --model={fv.model}: give one")
    init = hub.local_path(fv.init, "--init")
    if init is not None and not os.path.isdir(init):
        raise ValueError(f"--init={fv.init}: no such directory")
    path = hub.local_path(fv.tokenizer, "--tokenizer")
    if path is None:
        if init is None:
            raise ValueError("--tokenizer: required unless --init names a policy checkpoint")
        init = os.path.abspath(init)
        path = saved_policy.default_tokenizer_path(init, os.path.dirname(init))
    tok = tokenizer_lib.load(path)
    return tok, init or model_lib.get(fv.model, vocab_size=tok.vocab_size)


def train_and_save(fv: flags.FlagValues, head, rows, heldout, tok, cfg, model, **names) -> dict:
    """`scalar_head.train_and_save` of `head`'s (a module's) `train` and `save` into `--out`,
    for `--steps` steps; `names`: its `kind`, `rows_name` and `metric`."""
    cli.make_dir(fv.out, "--out")
    return scalar_head.train_and_save(
        head.train, head.save, rows, heldout, tok, cfg, fv.steps, model, fv.out, **names
    )


def settings(fv: flags.FlagValues, names: tuple) -> dict:
    """The flags' values of the `TrainSettings` fields `names`."""
    return {name: fv[name].value for name in names}
