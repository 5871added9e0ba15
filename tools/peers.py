"""rlscale against its peers: TRL's GRPOTrainer on the quickstart, transformers' `generate`
against rlscale's sampler.

    pip install -e .[peers]
    python tools/peers.py [--seeds 0,1] [--steps 80] [--workdir /tmp/rlscale_peers]
        [--out peers.json] [--skip_trl] [--skip_rlscale] [--skip_warm] [--skip_generate]

1. The quickstart's warm start (`configs/quickstart.py`, trained once in WORKDIR/warm or
   reused from there), exported with `save_hf` (tokenizer and stop tokens included) to
   WORKDIR/warm/hf.
2. rlscale: the quickstart RL loop from that warm start (`python -m rlscale.main --config
   configs/quickstart.py --config.sft.reuse_from=WORKDIR/warm --config.seed=S`), one process
   per seed; its metrics.jsonl gives the step times and the held-out evaluations. Each seed
   runs twice: with an empty persistent compilation cache (`rlscale`: every program compiled
   in the run, a first run on a machine) and again with the cache the first run filled
   (`rlscale_warm`: what a sweep's later runs and a resumed run pay; `--skip_warm` skips it).
3. TRL: `GRPOTrainer` on the exported warm start with the closest settings (`trl_config`
   lists them and what cannot be matched), rewarded by the quickstart task's verifier through
   rlscale's scorer, prompts as rlscale formats them (the exported tokenizer adds the BOS as
   `chat.encode_prompt` does). Every `eval.every` steps its policy is read back into rlscale
   (`save_pretrained` -> `load_hf`) and evaluated by rlscale's evaluator on the quickstart's
   held-out problems, with the keys rlscale's run uses at that step.
4. Sampler vs `generate`: greedy completions of the first 32 and 128 held-out prompts from
   the exported warm start, tokens/s and how many completions are identical.

Both systems are timed the same way: a step is rollouts + rewards + update (rlscale's
`time/step_s`; TRL from `on_step_begin` to `on_step_end`), evaluation excluded. Seconds per
step is the median over steps 5-20; time to pass@1 X is the summed step time up to the first
evaluation at or above X (rlscale's includes its compilation); final pass@1 is the last
evaluation. Results: docs/benchmarks.md.
"""

import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from rlscale import cli, console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THRESHOLDS = (0.5, 0.7)
STEP_WINDOW = (5, 20)  # Steps whose median time is "seconds per step": past warm-up.
SYSTEMS = ("rlscale", "rlscale_warm", "trl")


# ------------------------------------------------------------------------------------------
# The numbers: from a run's records (one dict per step: `step`, `time/step_s`, and
# `eval/pass@1` at evaluated steps; step 0 is the evaluation before training).
# ------------------------------------------------------------------------------------------


def summarize(records: list[dict], thresholds=THRESHOLDS, window=STEP_WINDOW) -> dict:
    """Seconds per step (median over `window`, inclusive), time to each held-out pass@1
    threshold (summed step time through the first evaluated step at or above it; None if
    none is) and that step (which, unlike times, a busy machine does not change), and the
    final pass@1 (the last evaluation)."""
    records = sorted(records, key=lambda r: r["step"])
    times = [r["time/step_s"] for r in records if window[0] <= r["step"] <= window[1]]
    out = {"seconds_per_step": statistics.median(times) if times else None}
    elapsed, reached = 0.0, {}
    for r in records:
        elapsed += r.get("time/step_s") or 0.0  # Step 0 (evaluation only) has none.
        p = r.get("eval/pass@1")
        for th in thresholds:
            if p is not None and p >= th and th not in reached:
                reached[th] = (elapsed, r["step"])
    for th in thresholds:
        out[f"time_to_{th}_s"], out[f"steps_to_{th}"] = reached.get(th, (None, None))
    evals = [r["eval/pass@1"] for r in records if r.get("eval/pass@1") is not None]
    out["final_pass@1"] = evals[-1] if evals else None
    out["steps"] = records[-1]["step"] if records else 0
    return out


def mean_over_seeds(per_seed: dict) -> dict:
    """Each number's mean over seeds; None if any seed lacks it (a threshold not reached)."""
    keys = next(iter(per_seed.values())).keys()
    out = {}
    for k in keys:
        values = [s[k] for s in per_seed.values()]
        out[k] = None if any(v is None for v in values) else statistics.fmean(values)
    return out


def ratios(ours: dict, theirs: dict) -> dict:
    """TRL / rlscale for times (> 1: rlscale faster), rlscale - TRL for final pass@1."""
    out = {}
    for k in ("seconds_per_step", *(f"time_to_{th}_s" for th in THRESHOLDS)):
        a, b = ours.get(k), theirs.get(k)
        out[k] = b / a if a and b is not None else None
    a, b = ours.get("final_pass@1"), theirs.get("final_pass@1")
    out["final_pass@1_diff"] = a - b if a is not None and b is not None else None
    return out


def read_metrics(path: str) -> list[dict]:
    """The records of an rlscale run's metrics.jsonl."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------
# The warm start, its export, and rlscale's runs.
# ------------------------------------------------------------------------------------------


def quickstart_config(steps: int):
    spec = importlib.util.spec_from_file_location(
        "quickstart", os.path.join(ROOT, "configs", "quickstart.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.steps = steps
    return config


def warm_start(config, workdir: str):
    """The quickstart's parts built in WORKDIR/warm (training the warm start there once) and
    the warm start exported to WORKDIR/warm/hf: (setup, hf_dir)."""
    from rlscale import rl
    from rlscale.model import hf
    from rlscale.rl import setup

    warm = os.path.join(workdir, "warm")
    s = setup.build(rl.resolve(config), warm)
    hf_dir = os.path.join(warm, "hf")
    hf.save_hf(hf_dir, s.model_cfg, s.params, tokenizer=s.tokenizer, stop_tokens=s.scfg.stop_tokens)
    print(f"warm start {s.warm_start_summary}, exported to {hf_dir}", flush=True)
    return s, hf_dir


def run_rlscale(workdir: str, seed: int, steps: int, warm: bool = False) -> list[dict]:
    """The quickstart from the shared warm start, in its own process; its metric records.
    The seed's compilation cache starts empty, or with `warm` holds what the cold run put in."""
    run_dir = os.path.join(workdir, f"rlscale{'_warm' if warm else ''}_seed{seed}")
    cache = os.path.join(workdir, "jax_cache", f"seed{seed}")
    if not warm:
        shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # A fresh run, not a resumed one.
    os.makedirs(run_dir)
    cmd = [
        sys.executable,
        "-m",
        "rlscale.main",
        "--config",
        os.path.join(ROOT, "configs", "quickstart.py"),
        "--workdir",
        run_dir,
        f"--config.seed={seed}",
        f"--config.steps={steps}",
        f"--config.sft.reuse_from={os.path.join(workdir, 'warm')}",
        f"--compilation_cache={cache}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    print(f"rlscale seed {seed}: {' '.join(cmd)}", flush=True)
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


# ------------------------------------------------------------------------------------------
# TRL.
# ------------------------------------------------------------------------------------------

# Settings of the quickstart that TRL's GRPOTrainer has no way to express.
UNMATCHED = (
    "loss aggregation: rlscale averages each prompt's tokens, then the prompts "
    "(aggregate(mode=prompt_mean)); TRL's cispo loss averages over all tokens of the batch",
    "zero-variance filter: rlscale drops the prompts whose samples all score the same before "
    "the update (filters.zero_variance); TRL keeps them, with advantage 0, in its token count",
    "advantage scale: rlscale divides by the std of the group-centred rewards over the batch "
    "(+1e-6); TRL's scale_rewards='batch' by the std of the raw rewards (+1e-4)",
    "prompt order: rlscale's PromptStream and TRL's shuffled RepeatSampler draw different "
    "prompts for the same seed",
)


def trl_config(config, seed: int, output_dir: str):
    """GRPOConfig with the quickstart's settings where TRL has them (`UNMATCHED`: where not)."""
    import trl

    o, P, G = config.optim, config.batch.prompts, config.batch.group_size
    if o.schedule != "constant":
        raise ValueError(f"optim.schedule={o.schedule!r}: only 'constant' is mapped to TRL")
    return trl.GRPOConfig(
        output_dir=output_dir,
        seed=seed,
        max_steps=config.steps,
        # One generation batch of P prompts x G samples per optimizer step, as rlscale's
        # learner (epochs=1, minibatches=1) takes one update per batch.
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        num_iterations=config.learner.epochs,
        max_completion_length=config.sampling.max_new_tokens,
        temperature=config.sampling.temperature,
        top_k=config.sampling.top_k,
        top_p=config.sampling.top_p,
        # The same AdamW: linear warmup from 0 then constant (optax's join of linear and
        # constant schedules), global-norm clipping, no KL term.
        learning_rate=o.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=o.warmup_steps,
        optim="adamw_torch",
        adam_beta1=o.b1,
        adam_beta2=o.b2,
        adam_epsilon=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip,
        beta=0.0,
        # CISPO with the quickstart's cap: TRL's epsilon_high is eps_max for this loss
        # (sg(min(ratio, epsilon_high)) * A * logp, trl/trainer/grpo_trainer.py).
        loss_type="cispo",
        epsilon_high=_chain_arg(config.objective.chain, "cispo", "eps_max"),
        scale_rewards="batch",
        mask_truncated_completions=False,
        # float32 on the CPU, like the quickstart; no recomputation in the backward pass.
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
    )


def _chain_arg(chain: str, transform: str, arg: str) -> float:
    """A number argument of one transform of a config's chain string."""
    from rlscale.objectives import registry

    for name, kwargs in registry.parse(chain):
        if name == transform:
            return float(kwargs[arg])
    raise ValueError(f"objective.chain {chain!r} has no {transform}({arg}=...)")


def run_trl(s, hf_dir: str, workdir: str, seed: int) -> list[dict]:
    """TRL's GRPOTrainer from the exported warm start; one record per step (step time, and
    rlscale's evaluation of the policy every `eval.every` steps and at the end)."""
    import datasets
    import torch
    import transformers
    import trl

    config = s.config
    out_dir = os.path.join(workdir, f"trl_seed{seed}")
    shutil.rmtree(out_dir, ignore_errors=True)
    args = trl_config(config, seed, out_dir)
    transformers.set_seed(seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    train = datasets.Dataset.from_dict(
        {
            "prompt": [p.prompt for p in s.train_problems],
            "problem": list(range(len(s.train_problems))),
        }
    )
    clock = _trl_clock(_trl_evaluator(s, seed), config.eval.every, config.steps, seed)
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=[_trl_reward(s)],
        args=args,
        train_dataset=train,
        processing_class=transformers.AutoTokenizer.from_pretrained(hf_dir),
        callbacks=[clock],
    )
    print(f"trl seed {seed}: GRPOTrainer, {torch.get_num_threads()} torch threads", flush=True)
    trainer.train()
    return clock.records


def _trl_reward(s):
    """TRL's reward function: TRL's completions decoded as rlscale decodes its own (stop
    token dropped), then scored by the quickstart's verifier in rlscale's verifier pool."""
    import numpy as np

    from rlscale.sampling import scoring

    tok, M = s.tokenizer, s.config.sampling.max_new_tokens

    def reward(prompts, completions, completion_ids, problem, **_):
        del prompts, completions
        tokens = np.full((len(completion_ids), M), tok.padding_id, np.int32)
        for i, ids in enumerate(completion_ids):
            tokens[i, : len(ids)] = ids
        lengths = np.array([len(ids) for ids in completion_ids])
        texts = scoring.completions_text(tok, tokens, lengths)
        rewards, _ = s.train_scorer(texts, [s.train_problems[i] for i in problem])
        return [float(r) for r in rewards]

    return reward


def _trl_evaluator(s, seed: int):
    """evaluate(policy, step) -> rlscale's held-out metrics of a TRL policy, read back into
    rlscale (`save_pretrained` -> `load_hf`)."""
    import jax

    from rlscale import sharding
    from rlscale.model import hf

    def evaluate(policy, step: int) -> dict:
        with tempfile.TemporaryDirectory() as d:
            policy.save_pretrained(d)
            cfg, _, params = hf.load_hf(d, mesh=s.mesh, rules=sharding.SAMPLE_RULES)
        if cfg != s.model_cfg:
            raise ValueError(f"TRL's policy reads back as {cfg}, not {s.model_cfg}")
        # The keys rlscale's run evaluates with at this step (rl/loop.py, rl/state.py).
        rng = jax.random.fold_in(jax.random.key(seed), 10**6 + step)
        return s.evaluate(params, rng)

    return evaluate


def _trl_clock(evaluate, every: int, steps: int, seed: int):
    """A trainer callback that times each optimizer step (generation, rewards, loss, update)
    and evaluates the policy (`evaluate(policy, step)`) before training, every `every` steps
    and at step `steps`, outside the timed span; its `records` are `run_trl`'s."""
    import transformers

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.records = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.records.append({"step": 0, **evaluate(model, 0)})

        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            record = {"step": state.global_step, "time/step_s": time.perf_counter() - self.t}
            if state.global_step % every == 0 or state.global_step == steps:
                record.update(evaluate(model, state.global_step))
                print(
                    f"trl seed {seed} step {state.global_step}: "
                    f"{record['time/step_s']:.2f} s, pass@1 {record['eval/pass@1']:.3f}",
                    flush=True,
                )
            self.records.append(record)

    return Clock()


# ------------------------------------------------------------------------------------------
# Sampler vs generate.
# ------------------------------------------------------------------------------------------


def sampler_vs_generate(s, hf_dir: str, batches=(32, 128), repeats: int = 3) -> list[dict]:
    """Greedy completions of the first B held-out prompts by rlscale's sampler and by
    transformers' `generate`, on the same exported weights: useful tokens/s (stop token
    included; median of `repeats` runs after an untimed first one, which compiles rlscale's
    program) and identical completions."""
    import jax
    import numpy as np
    import torch
    import transformers

    from rlscale.sampling import scoring

    scfg = dataclasses.replace(s.scfg, temperature=0.0, num_samples=1)
    stop = set(scfg.stop_tokens)
    M = scfg.max_new_tokens
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    policy = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    params, _ = s.sampler_params(s.params)
    rows = []
    for B in batches:
        problems = s.test_problems[:B]
        prompt_ids = scoring.encode_prompts(s.tokenizer, problems)

        def ours(prompt_ids=prompt_ids):
            out = s.sampler(params, prompt_ids, jax.random.key(0), scfg)
            return np.asarray(out.tokens), np.asarray(out.lengths)

        batch = hf_tok([p.prompt for p in problems], padding=True, return_tensors="pt")
        for row, mask, ids in zip(batch["input_ids"], batch["attention_mask"], prompt_ids):
            if row[mask.bool()].tolist() != ids:
                raise ValueError("transformers' tokenizer does not give rlscale's prompt ids")

        def theirs(batch=batch):
            with torch.no_grad():
                out = policy.generate(**batch, max_new_tokens=M, do_sample=False)
            completions = []
            for row in out[:, batch["input_ids"].shape[1] :].tolist():
                end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
                completions.append(row[:end])
            return completions

        timings = {}
        for name, fn in (("rlscale", ours), ("generate", theirs)):
            t = time.perf_counter()
            result = fn()
            first = time.perf_counter() - t
            seconds = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - t)
            timings[name] = (result, statistics.median(seconds), first)
        (tokens, lengths), ours_s, ours_first = timings["rlscale"]
        completions, theirs_s, theirs_first = timings["generate"]
        ours_list = [tokens[i, : lengths[i]].tolist() for i in range(B)]
        rows.append(
            {
                "batch": B,
                "max_new_tokens": M,
                "rlscale_tokens_per_s": int(lengths.sum()) / ours_s,
                "generate_tokens_per_s": sum(map(len, completions)) / theirs_s,
                "rlscale_s": ours_s,
                "generate_s": theirs_s,
                "rlscale_first_call_s": ours_first,
                "generate_first_call_s": theirs_first,
                "identical": sum(a == b for a, b in zip(ours_list, completions)),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------------------------------
# The report.
# ------------------------------------------------------------------------------------------


def machine() -> dict:
    import jax

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else info["cpu"]
    except OSError:
        pass
    for name in ("torch", "transformers", "trl"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        info["commit"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def print_report(report: dict) -> None:
    timed = ("seconds_per_step", *(f"time_to_{th}_s" for th in THRESHOLDS))
    keys = (*timed, *(f"steps_to_{th}" for th in THRESHOLDS), "final_pass@1")
    print("\n| system | seed | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (len(keys) + 2))
    for system in SYSTEMS:
        if system not in report:
            continue
        for seed, numbers in report[system]["seeds"].items():
            print(f"| {system} | {seed} | " + " | ".join(_fmt(numbers[k]) for k in keys) + " |")
        print(f"| {system} | mean | " + " | ".join(_fmt(report[system][k]) for k in keys) + " |")
    for key, ours in (("ratios", "rlscale"), ("ratios_warm", "rlscale_warm")):
        if key in report:
            r = report[key]
            print(
                f"\nTRL / {ours}: "
                + ", ".join(f"{k} {_fmt(r[k])}x" for k in timed)
                + f"; final pass@1 {ours} - TRL {_fmt(r['final_pass@1_diff'], '+.3f')}"
            )
    if "sampler_vs_generate" in report:
        print("\n| batch | rlscale tokens/s | generate tokens/s | identical |")
        print("| --- | --- | --- | --- |")
        for row in report["sampler_vs_generate"]:
            print(
                f"| {row['batch']} | {row['rlscale_tokens_per_s']:.0f} | "
                f"{row['generate_tokens_per_s']:.0f} | {row['identical']}/{row['batch']} |"
            )


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_list("seeds", ["0", "1"], "comma-separated RL seeds", flag_values=fv)
    flags.DEFINE_integer("steps", 80, "RL steps per run", flag_values=fv)
    flags.DEFINE_string("workdir", "/tmp/rlscale_peers", "runs and records", flag_values=fv)
    flags.DEFINE_string("out", None, "write the numbers as JSON here", flag_values=fv)
    flags.DEFINE_bool("skip_rlscale", False, "no rlscale runs", flag_values=fv)
    flags.DEFINE_bool("skip_warm", False, "no second, warm-cache rlscale run", flag_values=fv)
    flags.DEFINE_bool("skip_trl", False, "no TRL runs", flag_values=fv)
    flags.DEFINE_bool("skip_generate", False, "no sampler vs `generate`", flag_values=fv)


def main(fv: flags.FlagValues) -> None:
    console.configure(0)  # The in-process warm start without TFDS's progress bars.
    seeds = [int(x) for x in fv.seeds]
    cli.make_dir(fv.workdir, "--workdir")
    config = quickstart_config(fv.steps)
    report = {
        "machine": machine(),
        "command": " ".join(["python", "tools/peers.py", *sys.argv[1:]]),
        "settings": {
            "prompts": config.batch.prompts,
            "group_size": config.batch.group_size,
            "max_new_tokens": config.sampling.max_new_tokens,
            "steps": fv.steps,
            "eval": {"every": config.eval.every, "prompts": config.eval.prompts},
            "trl_unmatched": list(UNMATCHED),
        },
    }
    s, hf_dir = warm_start(config, fv.workdir)
    skip = {"rlscale": fv.skip_rlscale, "rlscale_warm": fv.skip_rlscale or fv.skip_warm}
    systems = [x for x in SYSTEMS if not skip.get(x, fv.skip_trl)]
    runs = {x: {} for x in systems}
    try:
        if not fv.skip_generate:
            report["sampler_vs_generate"] = sampler_vs_generate(s, hf_dir)
        # Seed by seed, the systems in turn: both meet the same background load on a shared
        # machine. The load averages (1, 5, 15 min) after each run say what that load was.
        for seed in seeds:
            for system in systems:
                if system.startswith("rlscale"):
                    records = run_rlscale(fv.workdir, seed, fv.steps, system == "rlscale_warm")
                else:
                    records = run_trl(s, hf_dir, fv.workdir, seed)
                runs[system][seed] = records
                report.setdefault("load_avg", {}).setdefault(system, {})[str(seed)] = [
                    round(x, 2) for x in os.getloadavg()
                ]
    finally:
        s.close()
    for system, by_seed in runs.items():
        per_seed = {str(seed): summarize(records) for seed, records in by_seed.items()}
        report[system] = {**mean_over_seeds(per_seed), "seeds": per_seed}
        with open(os.path.join(fv.workdir, f"{system}_records.json"), "w") as f:
            json.dump({str(k): v for k, v in by_seed.items()}, f)
    if "trl" in report:
        for ours, key in (("rlscale", "ratios"), ("rlscale_warm", "ratios_warm")):
            if ours in report:
                report[key] = ratios(report[ours], report["trl"])
    print_report(report)
    if fv.out:
        with open(fv.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {fv.out}")


if __name__ == "__main__":
    cli.run_command(define_flags, main)
