"""Learned rewards in the RL loop: a reward model's score as the outcome reward (`reward.model`, or
one trained at set-up: a stage of the run's cache, `stage_cache.REWARD_MODEL`) and a PRM's step
rewards (`reward.prm`), their FLOPs counted. See docs/preference_and_reward_models.md.

Dimension letters: N rows, P padded prompt length, M completion tokens.
"""

import time

import numpy as np

from rlscale import stage_cache
from rlscale.eval import best_of_n
from rlscale.reward_models import bradley_terry
from rlscale.reward_models import prm as prm_lib
from rlscale.rl import pairs as pairs_lib
from rlscale.scaling import compute

# `reward.model`: trained at set-up from the warm start on pairs sampled from it.
TRAIN_AT_SETUP = "train_at_setup"
HELDOUT_EVERY = 10  # Every 10th pair sampled from the warm start is held out.


def _flops(model_cfg, lengths_N) -> float:
    """A forward pass over rows of `lengths_N` tokens, each attending to their mean length."""
    return compute.forward_flops(model_cfg, float(np.sum(lengths_N)), np.mean(lengths_N) / 2)


class OutcomeReward:
    """A reward model's r(x, y) of each sampled row (`reward_model.RewardModel`), scored as
    best-of-N scores them (`best_of_n.reward_model_ranker`), and the forward FLOPs it took."""

    def __init__(self, rm: bradley_terry.RewardModel):
        self.rm, self._score = rm, best_of_n.reward_model_ranker(rm).score

    def __call__(self, samples) -> tuple[np.ndarray, float]:
        reward_N = self._score(samples, None).astype(np.float32)
        G = len(samples.lengths_N) // len(samples.prompt_BP)
        lengths_N = np.repeat(samples.prompt_mask_BP.sum(1), G) + samples.lengths_N
        return reward_N, _flops(self.rm.model_cfg, lengths_N)


class StepRewards:
    """A PRM's (step_reward [N, M], step_mask [N, M]) of a batch (`Rollouts`), and the
    forward FLOPs it took. M is the batch's completion width; the PRM scores each row's
    prompt and completion tokens (forced-interruption text included: it is context the
    policy continued from)."""

    def __init__(self, prm: prm_lib.ProcessRewardModel):
        self.prm = prm

    def __call__(self, roll) -> tuple[np.ndarray, np.ndarray, float]:
        P = roll.prompt_len
        prompt_ids = [t[:P][m[:P]].tolist() for t, m in zip(roll.tokens_NL, roll.attn_mask_NL)]
        completion_ids = [t[P:][m[P:]].tolist() for t, m in zip(roll.tokens_NL, roll.attn_mask_NL)]
        lengths_N = roll.attn_mask_NL.sum(1)
        prm = self.prm.with_bucket(int(lengths_N.max()))
        reward_NM, mask_NM = prm.step_rewards(prompt_ids, completion_ids, roll.mask_NM.shape[1])
        return reward_NM, mask_NM, _flops(prm.model_cfg, lengths_N)


def load_outcome(reward, mesh) -> OutcomeReward | None:
    """`reward.model`'s reward model (of the reward section, `isolation.RewardConfig`) when it
    names a directory (None without one, or for `TRAIN_AT_SETUP`, which `made_outcome` trains
    once the run has its policy)."""
    path = reward.model
    if path in ("", TRAIN_AT_SETUP):
        return None
    return OutcomeReward(bradley_terry.load(path, mesh))


def load_steps(reward, mesh) -> StepRewards | None:
    """`reward.prm`'s process reward model (None without one)."""
    return StepRewards(prm_lib.load(reward.prm, mesh)) if reward.prm else None


def made_settings(reward, pair_settings: dict) -> dict:
    """What the reward model trained at set-up depends on: the settings of its stage, its
    pairs' (`pair_settings`: `rl.pairs.made_settings`) and its training's (of the reward
    section)."""
    train = {k: getattr(reward, k) for k in ("model_steps", "model_batch_pairs", "model_lr")}
    return {"pairs": pair_settings, "reward": train}


def made_outcome(
    reward, seed: int, setup, pair_source, run, comp, workdir: str, fresh: bool
) -> OutcomeReward:
    """The reward model `reward.model` = `TRAIN_AT_SETUP` names: trained now on pairs sampled
    from the warm start (`pair_source`, an `rl.pairs.PairSource`, samples them), or read from
    the stage cache where an earlier start of the run left it (its settings:
    `setup.stage_settings`). A fresh run adds its making (sampling, training) to `comp`; the
    stage's record holds the cost and the held-out pair accuracy (`summary`)."""
    stage = stage_cache.REWARD_MODEL
    path = stage_cache.path(workdir, stage)
    record = stage_cache.lookup(workdir, stage, setup.stage_settings[stage])
    if record is None:
        if not fresh:
            raise ValueError(
                f"reward.model={TRAIN_AT_SETUP!r}: the reward model this run trained with "
                f"({path}) is missing; start a new workdir"
            )
        record = _make(reward, seed, setup, pair_source, run, workdir)
    if fresh:
        for k in ("compute/sample_flops", "compute/train_flops", "compute/device_seconds"):
            comp.counters[k] += record[k]
    return OutcomeReward(bradley_terry.load(path, setup.mesh))


def _make(c, seed: int, setup, pair_source, run, workdir: str) -> dict:
    """Trains and saves the `TRAIN_AT_SETUP` reward model (of the reward section `c`) in its
    stage, from the warm start's stage; returns the stage's record."""
    t, M = time.time(), setup.scfg.max_new_tokens
    # The pairs (cached by an earlier start that stopped before the model was saved, or made
    # now) and what sampling them cost.
    made = pairs_lib.read_made(workdir, pair_source.settings)
    pairs, made_record = made or pair_source.make(run)
    ctx = made_record["prompt_len"] + M / 2
    sample_flops = compute.forward_flops(setup.model_cfg, made_record["sampled_tokens"], ctx)
    heldout = pairs[::HELDOUT_EVERY]
    train = [p for i, p in enumerate(pairs) if i % HELDOUT_EVERY]
    cfg = bradley_terry.RMConfig(
        seq_len=setup.generator.max_prompt_len + M + 1,
        batch_pairs=c.model_batch_pairs,
        lr=c.model_lr,
        seed=seed,
        eval_every=c.model_steps,
    )
    trained = bradley_terry.train(
        train,
        setup.tokenizer,
        cfg,
        c.model_steps,
        model=stage_cache.path(workdir, stage_cache.WARM_START),
        heldout=heldout,
    )
    path = stage_cache.begin(workdir, stage_cache.REWARD_MODEL)
    bradley_terry.save(
        path, trained.model_cfg, trained.params, setup.tokenizer, cfg, trained.history
    )
    rows = 2 * c.model_batch_pairs * c.model_steps  # Padded to the bucket, as trained.
    record = {
        "compute/sample_flops": sample_flops,
        "compute/train_flops": compute.train_flops(
            trained.model_cfg, rows * cfg.seq_len, cfg.seq_len / 2
        ),
        "compute/device_seconds": (time.time() - t) * setup.mesh.devices.size,
        "train_pairs": len(train),
        "heldout_pairs": len(heldout),
        "heldout_accuracy": trained.history[-1].heldout_accuracy,
    }
    stage = stage_cache.REWARD_MODEL
    stage_cache.complete(workdir, stage, setup.stage_settings[stage], record)
    return record


def summary(workdir: str) -> dict:
    """The `TRAIN_AT_SETUP` reward model's held-out pair accuracy and pair counts ({}
    without one)."""
    record = stage_cache.record(workdir, stage_cache.REWARD_MODEL)
    if record is None:
        return {}
    keys = ("train_pairs", "heldout_pairs", "heldout_accuracy")
    return {f"reward_model/{k}": record[k] for k in keys}
