"""Evaluates a params checkpoint on its config's task (`rlscale.eval.harness`):

    python -m rlscale.main.evaluate --config configs/quickstart.py --checkpoint WORKDIR/final \\
        [--split test --k 8 --n 64] [--best_of 1,2,4,8 --scorer logprob,prm --prm DIR] \\
        [--step_search W,E --prm DIR]

prints the metrics (and the test-time scaling and step-search tables) and writes the JSON
report (default WORKDIR/eval_{split}.json). See docs/evaluation.md.
"""

from absl import flags

from rlscale import cli, hub, saved_policy
from rlscale.eval import best_of_n, harness, step_search


def define_flags(fv: flags.FlagValues, argv) -> None:
    cli.define_config(fv, argv)
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Params checkpoint (checkpoint.save_params), e.g. WORKDIR/final.",
        flag_values=fv,
    )
    flags.DEFINE_string("split", "test", "Split of the task to evaluate on.", flag_values=fv)
    flags.DEFINE_integer("k", 8, "Completions sampled per prompt.", flag_values=fv)
    flags.DEFINE_integer(
        "n", 64, "Prompts: the first n of the split (all if fewer).", flag_values=fv
    )
    flags.DEFINE_string("tokenizer", None, "Tokenizer path (see tokenizers.load).", flag_values=fv)
    flags.DEFINE_string(
        "workdir",
        None,
        "Run directory (data cache, tokenizer); default: the checkpoint's parent.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "output", None, "Metrics JSON; default WORKDIR/eval_{split}.json.", flag_values=fv
    )
    flags.DEFINE_integer("batch", 32, "Prompts per sampler call.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", flag_values=fv)
    flags.DEFINE_list(
        "best_of",
        None,
        "N values for the test-time scaling curves, e.g. 1,2,4,8,16 (each <= k).",
        flag_values=fv,
    )
    flags.DEFINE_list(
        "scorer",
        ["logprob"],
        f"Best-of-N and weighted-vote scorers: {', '.join(best_of_n.SCORERS)}.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "reward_model",
        None,
        "Reward model directory (python -m rlscale.main.train_reward_model).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "prm",
        None,
        "Process reward model directory (python -m rlscale.main.train_prm).",
        flag_values=fv,
    )
    flags.DEFINE_list(
        "prm_aggregation",
        ["min"],
        "How --scorer=prm scores a completion: min, last, product.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "plot",
        None,
        "Test-time scaling PNG; default WORKDIR/test_time_{split}.png.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "step_search",
        None,
        "W,E: PRM-guided beam search over steps (rlscale.eval.step_search), W partial "
        "solutions per problem, each continued E ways per step; needs --prm.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "step_search_aggregation",
        step_search.DEFAULT_AGGREGATION,
        "How --step_search scores a prefix from its step probabilities: last, min, product.",
        flag_values=fv,
    )
    flags.mark_flag_as_required("checkpoint", flag_values=fv)


def main(f: flags.FlagValues) -> dict:
    # Directories may be Hugging Face Hub names (docs/hugging_face.md).
    checkpoint, workdir = hub.local_path(f.checkpoint, "--checkpoint"), f.workdir
    if checkpoint != f.checkpoint and workdir is None:
        raise ValueError(f"--checkpoint={f.checkpoint} is on the Hugging Face Hub: pass --workdir")
    report = harness.run(
        saved_policy.resolve(f.config),
        checkpoint,
        split=f.split,
        k=f.k,
        n=f.n,
        tokenizer_path=hub.local_path(f.tokenizer, "--tokenizer"),
        workdir=workdir,
        output=f.output,
        batch=f.batch,
        seed=f.seed,
        best_of=f.best_of,
        scorers=f.scorer,
        reward_model_dir=hub.local_path(f.reward_model, "--reward_model"),
        prm_dir=hub.local_path(f.prm, "--prm"),
        prm_aggregation=f.prm_aggregation,
        plot=f.plot,
        step_search=f.step_search,
        step_search_aggregation=f.step_search_aggregation,
    )
    cli.print_summary("rlscale evaluation", report["metrics"], width=28)
    if "test_time" in report:
        print("\ntest-time scaling (mean over problems; unbiased over the N-subsets of k)")
        print(best_of_n.table(report["test_time"]))
        print(f"  plot: {report['test_time_plot']}")
    if "step_search" in report:
        print("\nstep search (PRM-guided beam search over steps)")
        print(step_search.table(report["step_search"]))
    return report


if __name__ == "__main__":
    cli.run_command(define_flags, main)
