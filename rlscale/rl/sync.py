"""The synchronous driver: sample a batch with the current policy, score it, update, repeat.

Each step reshards the params to the generator's layout, draws rollouts from the
`RolloutSource`, lets the `Learner` update on them and writes one metrics line. Host work
overlaps device work where the order allows: requests are scored while the rest decode, and
the next batch's prompts are encoded while the update runs. Every part lives in its own
module of `rlscale.rl`; this file only orders them. A workdir holding checkpoints resumes
from the latest readable one.
"""

import dataclasses
import time

import jax

from rlscale import sharding
from rlscale.rl import loop, report


def run(config, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) the RL loop in `workdir` (`config`: the resolved run,
    `rl.resolve`); returns the summary."""
    lp = loop.Loop(config, workdir, allow_config_change)
    s, run, source, comp = lp.s, lp.run, lp.source, lp.comp
    devices = s.mesh.devices.size
    engine = s.generator.stats
    with lp.running():
        for step in range(lp.start + 1, config.steps + 1):
            t_sample = time.time()
            seen = dataclasses.replace(engine)
            params, reshard_s = s.generator_params(run.train.params)
            version = int(sharding.fetch(run.train.step))
            roll, stats = source.next(params, jax.random.fold_in(run.rng, step), version)
            t_update = time.time()
            train, mets, applied = s.learner.update(run.train, s.ref_params, roll, step)
            source.prefetch()  # While the device trains.
            run.train = jax.block_until_ready(train)
            t_done = time.time()
            comp.add_step(s.model_cfg, stats, roll, s.learner.forward_passes)
            comp.add_seconds(t_done - t_sample, devices)
            times = {
                "time/sample_s": t_update - t_sample,
                "time/update_s": t_done - t_update,
                "time/step_s": t_done - t_sample,
                "time/reshard_s": reshard_s,
            }
            record = lp.record(step, stats, mets, applied, times)
            record.update(report.staleness(roll, version))  # Always 0 here: sampled now.
            record.update(report.generator_record(seen, engine))
            lp.end_step(step, record)
    return lp.finish()
