"""The preference driver: offline and iterative DPO (and IPO, SimPO, KTO) on the RL loop's parts,
one `Learner.update` on pairs per step. See docs/preference_and_reward_models.md.
"""

import time

import jax

from rlscale.rl import loop, pairs, report


def run(config, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) a preference run in `workdir`; returns the summary."""
    lp = loop.Loop(config, workdir, allow_config_change)
    s, run, comp = lp.s, lp.run, lp.comp
    source = pairs.PairSource(config, s, lp.source, workdir)
    every, devices = config.preference.iterations_every, s.mesh.devices.size
    with lp.running():
        source.start(run, comp, fresh=lp.start == 0)
        for step in range(lp.start + 1, config.steps + 1):
            t_sample = time.time()
            sampled = None
            if every and (step - 1) % every == 0:
                sampled = source.new_round(run, comp, step)
            t_update = time.time()
            roll, ids = source.batch(run.pairs)
            mets, applied = {}, []
            if roll is not None:
                train, mets, applied = s.learner.update(
                    run.train, source.reference(run), roll, step
                )
                run.train = jax.block_until_ready(train)
                comp.add_training(s.model_cfg, roll, s.learner.forward_passes)
            t_done = time.time()
            comp.add_seconds(t_done - t_sample, devices)
            times = {
                "time/sample_s": t_update - t_sample,
                "time/update_s": t_done - t_update,
                "time/step_s": t_done - t_sample,
            }
            skipped = lp.skipped(step, applied)
            lp.end_step(
                step,
                report.pair_record(sampled, run.pairs, ids, mets, skipped=skipped, times=times),
            )
    return lp.finish()
