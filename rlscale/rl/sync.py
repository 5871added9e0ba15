"""The synchronous driver: sample a batch with the current policy, score it, update, repeat.

Each step reshards the params to the generator's layout, draws rollouts from the
`RolloutSource`, lets the `Learner` update on them and writes one metrics line. Every part
lives in its own module of `rlscale.rl`; this file only orders them. A workdir holding
checkpoints resumes from the latest readable one.
"""

import contextlib
import dataclasses
import os
import time

import jax

from rlscale import faults, metrics, preemption, sharding
from rlscale.rl import checks, report, setup, state


def run(config, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) the RL loop in `workdir`; returns the summary."""
    checks.validate(config)
    t_start = time.time()
    os.makedirs(workdir, exist_ok=True)
    s = setup.build(config, workdir)
    ckpt, run, start = state.open_checkpoints(s, workdir, allow_config_change)
    source = s.rollout_source(run.stream, run.history)
    comp = report.Compute(
        run.counters, max_new_tokens=config.sampling.max_new_tokens, epochs=config.learner.epochs
    )
    is_main = jax.process_index() == 0
    writer = metrics.MetricWriter(workdir, config.steps, is_main, run.metrics_offset)
    skips = faults.SkipCounter(config.faults.max_consecutive_skips)
    devices = s.mesh.devices.size
    engine = s.generator.stats

    def evaluate(step):
        t = time.time()
        params, _ = s.sampler_params(run.train.params)
        run.evals.append(s.evaluate(params, jax.random.fold_in(run.rng, 10**6 + step)))
        comp.add_seconds(time.time() - t, devices)
        return {**run.evals[-1], **comp.metrics()}

    def save(step, wait=False):
        ckpt.save(step, *run.state(writer.offset()))
        if wait:
            ckpt.wait()

    with preemption.PreemptionGuard() as guard, contextlib.ExitStack() as cleanup:
        for closer in (s.close, ckpt.close, writer.close):
            cleanup.callback(closer)
        if start == 0:
            writer.write(0, evaluate(0))
        for step in range(start + 1, config.steps + 1):
            t_sample = time.time()
            seen = dataclasses.replace(engine)
            params, reshard_s = s.generator_params(run.train.params)
            version = int(sharding.fetch(run.train.step))
            roll, stats = source.next(params, jax.random.fold_in(run.rng, step), version)
            t_update = time.time()
            train, batch, prep_metrics = s.learner.prepare(run.train, s.ref_params, roll)
            train, mets, applied = s.learner.update(train, batch, roll.prompt_len, step)
            run.train = jax.block_until_ready(train)
            t_done = time.time()
            for ok in map(bool, applied):  # Skipped non-finite updates; too many in a row stop.
                skips.update(ok, step, last_checkpoint=ckpt.latest_step())
            comp.add_step(s.model_cfg, stats, roll, s.learner.forward_passes)
            comp.add_seconds(t_done - t_sample, devices)
            times = {
                "time/sample_s": t_update - t_sample,
                "time/update_s": t_done - t_update,
                "time/step_s": t_done - t_sample,
            }
            record = report.step_record(
                stats,
                {**prep_metrics, **mets},
                retired=len(run.history.retired),
                skipped=sum(not bool(ok) for ok in applied),
                times={**times, "time/reshard_s": reshard_s},
            )
            record.update(report.staleness(roll, version))  # Always 0 here: sampled now.
            record.update(report.generator_record(seen, engine))
            record.update(comp.metrics())
            if step % config.eval.every == 0 or step == config.steps:
                record.update(evaluate(step))
            writer.write(step, record)
            if guard.should_stop(step):
                save(step, wait=True)
                raise preemption.PreemptedError(
                    f"preempted ({guard.signal_name}) after step {step}: checkpoint saved in "
                    f"{ckpt.directory}; rerun the same command to resume"
                )
            if step % config.checkpoint.every == 0 or step == config.steps:
                save(step, wait=step == config.steps)
    return report.finish(s, run, comp, workdir, time.time() - t_start)
