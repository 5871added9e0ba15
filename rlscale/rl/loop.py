"""What both drivers share: start-up (validation, the parts, the checkpoints to resume from,
the counters and the metrics writer), evaluation, the end of each step (skipped updates, the
metrics line, evaluation, preemption, checkpoints) and the finished run's files."""

import contextlib
import os
import time

import jax
import numpy as np

from rlscale import faults, metrics, preemption, tracking
from rlscale.rl import learned_rewards, pairs, report, setup, state


class Loop:
    """One run's shared machinery; a driver orders rollouts and updates between `running()`
    and `finish()`.

    Attributes:
      s: the run's parts (`setup.Setup`).
      run: its `RunState`; `start` the step it resumes after (0: fresh).
      source: the `RolloutSource` over the run's stream and history.
      comp: the compute counters.
    """

    def __init__(self, config, workdir: str, allow_config_change: bool):
        """`config`: the resolved run (`rl.resolve`)."""
        self.t_start = time.time()
        os.makedirs(workdir, exist_ok=True)
        self.s = s = setup.build(config, workdir)
        self.config, self.workdir = s.config, workdir
        self.ckpt, self.run, self.start = state.open_checkpoints(s, workdir, allow_config_change)
        self.comp = report.Compute(
            self.run.counters,
            max_new_tokens=config.sampling.max_new_tokens,
            epochs=config.learner.epochs,
            layout=s.learner.layout,
        )
        self.source = s.rollout_source(self.run.stream, self.run.history)
        if config.reward.model == learned_rewards.TRAIN_AT_SETUP:  # From the warm start.
            c = self.config
            made = pairs.PairSource(c.preference, c.batch, c.seed, s, self.source, workdir)
            self.source.outcome_model = learned_rewards.made_outcome(
                c.reward, c.seed, s, made, self.run, self.comp, workdir, fresh=self.start == 0
            )
        is_main = jax.process_index() == 0
        sink = tracking.sink(config.tracking, workdir, config.to_dict(), is_main)
        self.writer = metrics.MetricWriter(
            workdir, config.steps, is_main, self.run.metrics_offset, sink
        )
        self.skips = faults.SkipCounter(config.faults.max_consecutive_skips)
        self.guard = None

    @contextlib.contextmanager
    def running(self):
        """Preemption handling and cleanup around the steps (yields the cleanup stack, for a
        driver's own closers); a fresh run's step-0 evaluation first, while the programs
        whose shapes are known ahead compile in the background: the generator's decode
        (`Generator.precompile`) and, where one program serves every batch, the learner's
        update (`Learner.precompile`)."""
        with preemption.PreemptionGuard() as self.guard, contextlib.ExitStack() as cleanup:
            for closer in (self.s.close, self.source.close, self.ckpt.close, self.writer.close):
                cleanup.callback(closer)
            s, b = self.s, self.config.batch
            s.generator.precompile(s.generator_shapes(self.run.train.params))
            s.learner.precompile(self.run.train, s.ref_params, b.prompts * b.group_size)
            if self.start == 0:
                self.writer.write(0, self.evaluate(0))
            yield cleanup

    def evaluate(self, step: int) -> dict:
        """Held-out metrics of the current policy, sampled on the trainer's devices."""
        t = time.time()
        run = self.run
        params, _ = self.s.sampler_params(run.train.params)
        run.evals.append(self.s.evaluate(params, jax.random.fold_in(run.rng, 10**6 + step)))
        self.comp.add_seconds(time.time() - t, self.s.mesh.devices.size)
        return {**run.evals[-1], **self.comp.metrics()}

    def record(self, step: int, stats, learner_metrics, applied, times) -> dict:
        """The step's metrics line (before the compute counters); too many skipped
        (non-finite) updates in a row stop the run here."""
        return report.step_record(
            stats,
            learner_metrics,
            retired=len(self.run.history.retired),
            skipped=self.skipped(step, applied),
            times=times,
        )

    def skipped(self, step: int, applied) -> int:
        """How many of the step's optimizer updates were skipped (non-finite: `applied` is
        False); too many in a row stop the run here."""
        applied = np.asarray(applied)  # Waits for the update.
        for ok in map(bool, applied):
            self.skips.update(ok, step, last_checkpoint=self.ckpt.latest_step())
        return sum(not bool(ok) for ok in applied)

    def end_step(self, step: int, record: dict) -> None:
        """Adds the counters (and an evaluation when due), writes the line, then stops on
        preemption or checkpoints when due."""
        config, ckpt = self.config, self.ckpt
        record.update(self.comp.metrics())
        if step % config.eval.every == 0 or step == config.steps:
            record.update(self.evaluate(step))
        self.writer.write(step, record)
        if self.guard.should_stop(step):
            self._save(step, wait=True)
            raise preemption.PreemptedError(
                f"preempted ({self.guard.signal_name}) after step {step}: checkpoint saved in "
                f"{ckpt.directory}; rerun the same command to resume"
            )
        if step % config.checkpoint.every == 0 or step == config.steps:
            self._save(step, wait=step == config.steps)

    def _save(self, step, wait=False):
        self.ckpt.save(step, *self.run.state(self.writer.offset()))
        if wait:
            self.ckpt.wait()

    def finish(self) -> dict:
        """The summary; writes the final params, `summary.json` and `programs.json`."""
        return report.finish(self.s, self.run, self.comp, self.workdir, time.time() - self.t_start)
