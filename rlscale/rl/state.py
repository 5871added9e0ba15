"""`RunState`: everything an interrupted run needs to continue as the same run, in one place.

Device part: the learner's `TrainState` (policy and value params, optimizer state, the
objective's transform states, the update count) and the run's RNG key. Host part (JSON): the
prompt stream's epoch, cursor and shuffle seed, the pass-rate history and retired set, the
compute counters, the earlier evaluations, the length of `metrics.jsonl` and the resolved
config. The reference params are the warm start's, reloaded at start-up (never checkpointed),
except in iterative preference runs, whose reference is the policy at the current round's
start: there it is device state (`ref`), and the round's pairs host state (`pairs`). A LoRA
run's train state holds the adapters and their optimizer state, never the base: the host part
holds the base's identity (`base`: its source and fingerprint), which a resume checks against
the base it reloads.
"""

import dataclasses
import json
import os
from typing import Any

import jax
from absl import logging

from rlscale import checkpoint, config_lib, sharding
from rlscale.data import filters
from rlscale.rl import checks, report
from rlscale.rl import pairs as pairs_lib


@dataclasses.dataclass
class RunState:
    train: Any  # learner.TrainState
    rng: jax.Array
    stream: filters.PromptStream
    history: filters.PassRateHistory
    counters: dict
    evals: list
    config: dict
    metrics_offset: int | None = None  # Set when restored: where metrics.jsonl is cut back to.
    # Iterative preference runs: the reference params of the current round (None: the warm
    # start's, reloaded at start-up).
    ref: Any = None
    pairs: pairs_lib.PairSet | None = None  # Preference runs: the pairs in force and their draw.
    base: dict | None = None  # LoRA runs: the frozen base's identity (`Setup.base_identity`).

    def state(self, metrics_offset: int) -> tuple[dict, dict]:
        """(device tree, host dict) to checkpoint."""
        device = {"train": self.train, "rng": self.rng}
        if self.ref is not None:
            device["ref"] = self.ref
        host = {
            "stream": self.stream.state(),
            "history": self.history.state(),
            "counters": self.counters,
            "evals": self.evals,
            "metrics_offset": metrics_offset,
            "config": self.config,
            "pairs": None if self.pairs is None else self.pairs.state(),
            "base": self.base,
        }
        return device, host

    @classmethod
    def from_state(cls, device: dict, host: dict) -> "RunState":
        return cls(
            train=device["train"],
            rng=device["rng"],
            stream=filters.PromptStream.from_state(host["stream"]),
            history=filters.PassRateHistory.from_state(host["history"]),
            counters=host["counters"],
            evals=host["evals"],
            config=host["config"],
            metrics_offset=host["metrics_offset"],
            ref=device.get("ref"),  # Absent unless the run refreshes its reference.
            pairs=None
            if host.get("pairs") is None
            else pairs_lib.PairSet.from_state(host["pairs"]),
            base=host.get("base"),
        )


def abstract(tree, mesh):
    """Shape, dtype and sharding of each leaf: where a checkpoint restores onto. Leaves not on
    the mesh (fresh scalars) are replicated over it."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def leaf(x):
        s = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(leaf, tree)


def open_checkpoints(setup, workdir: str, allow_config_change: bool):
    """(checkpointer, run state, step to resume after): the latest readable checkpoint in
    `WORKDIR/checkpoints`, or a fresh state at step 0. A checkpoint made with a different
    config (beyond `checks.RESUMABLE_CHANGES`) is refused unless `allow_config_change`."""
    config = setup.config
    config_dict = config.to_dict()
    ckpt = checkpoint.RunCheckpointer(
        os.path.join(workdir, "checkpoints"),
        keep=config.checkpoint.keep,
        keep_every=config.checkpoint.keep_every,
    )
    train, stream, history = setup.initial_state()
    # Replicated over the mesh: every host checkpoints (and restores) the same key.
    rng = sharding.replicate(jax.random.key(config.seed), setup.mesh)
    fresh = RunState(train, rng, stream, history, report.Compute().counters, [], config_dict)
    fresh.base = setup.base_identity
    trained = report.trained_record(train)
    logging.info(
        "trained params: %d (%d bytes), optimizer state: %d bytes",
        *(trained[f"train/{k}"] for k in ("trained_params", "trained_bytes", "opt_state_bytes")),
    )
    if config.preference.enabled:
        fresh.pairs = pairs_lib.PairSet()
        if config.preference.iterations_every:  # Refreshed each round (None: no reference).
            fresh.ref = setup.ref_params
    start = 0
    if ckpt.latest_step() is not None:
        device, _ = fresh.state(0)
        start, device, host = ckpt.restore(abstract(device, setup.mesh))
        diff = checkpoint.config_diff(
            host["config"],
            config_dict,
            ignore=checks.RESUMABLE_CHANGES,
            defaults=config_lib.rl_config(),
        )
        if diff and not allow_config_change:
            ckpt.close()
            raise ValueError(
                f"{workdir} holds a run with a different config; pass --allow_config_change to "
                "resume it anyway, or use another workdir. Differences (saved -> now):\n  "
                + "\n  ".join(diff)
            )
        _check_base(host.get("base"), setup.base_identity, workdir, ckpt)
        fresh = RunState.from_state(device, {**host, "config": config_dict})
        logging.info("resuming from the checkpoint at step %d in %s", start, workdir)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2, sort_keys=True)
    return ckpt, fresh, start


def _check_base(saved: dict | None, now: dict | None, workdir: str, ckpt) -> None:
    """Refuses to resume a LoRA run's adapters onto another base than they were trained on
    (another fingerprint; the source may move with the workdir)."""
    if saved is None or now is None or saved["fingerprint"] == now["fingerprint"]:
        return
    ckpt.close()
    raise ValueError(
        f"{workdir} holds LoRA adapters trained on another base: {saved['source']} "
        f"(fingerprint {saved['fingerprint']}), and this run's base is {now['source']} "
        f"(fingerprint {now['fingerprint']}); use another workdir"
    )
