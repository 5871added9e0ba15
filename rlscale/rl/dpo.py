"""The preference driver: offline and iterative DPO (and IPO, SimPO, KTO) on the RL loop's parts,
one `Learner.update` on pairs per step. See docs/preference_and_reward_models.md.
"""

import dataclasses
import time

import jax

from rlscale import sections
from rlscale.data import formats, preferences
from rlscale.rl import loop, pairs, report


@dataclasses.dataclass(frozen=True)
class PreferenceConfig(sections.Section):
    """`config.preference`: a preference run trains on pairs from `file` (a jsonl/json/parquet
    file of prompt/chosen/rejected rows, or "sample_at_setup": pairs sampled once from the
    warm start), or in rounds of `iterations_every` steps whose pairs it samples (`samples`
    completions of `prompts` prompts, 0: the default); `pairs`: "best_vs_worst" or "all"."""

    file: str = ""
    iterations_every: int = 0
    samples: int = 8
    pairs: str = "best_vs_worst"
    prompts: int = 0

    @property
    def enabled(self) -> bool:
        """A preference run: a pair file or iterative rounds."""
        return bool(self.file) or bool(self.iterations_every)

    @property
    def samples_pairs(self) -> bool:
        """It samples the completions its pairs are formed from (iterative rounds, or pairs
        sampled at set-up), `samples` per prompt."""
        return bool(self.iterations_every) or self.file == pairs.SAMPLE_AT_SETUP

    @property
    def key(self) -> str:
        """The key that makes the run a preference run, for messages."""
        return "preference.file" if self.file else "preference.iterations_every"

    def problems(self) -> list[str]:
        """The keys' own values (what a preference run needs of other sections is
        `rl.checks`')."""
        if not isinstance(self.iterations_every, int) or self.iterations_every < 0:
            return [
                f"preference.iterations_every={self.iterations_every!r} must be an integer >= 0 "
                "(0: no rounds)"
            ]
        if not isinstance(self.file, str):
            return [f"preference.file={self.file!r} must be a path or ''"]
        if not self.enabled:
            return []
        problems = []
        if self.file and self.iterations_every:
            problems.append(
                f"preference.file={self.file!r} and preference.iterations_every="
                f"{self.iterations_every} are exclusive: offline DPO trains on a file's pairs, "
                "iterative DPO on pairs it samples each round; set one"
            )
        if self.pairs not in preferences.MODES:
            problems.append(f"preference.pairs={self.pairs!r} is not one of {preferences.MODES}")
        if not isinstance(self.prompts, int) or self.prompts < 0:
            problems.append(
                f"preference.prompts={self.prompts!r} must be an integer >= 0 (0: default)"
            )
        if self.samples_pairs:
            if not isinstance(self.samples, int) or self.samples < 2:
                problems.append(
                    f"preference.samples={self.samples!r} must be an integer >= 2: pairs are "
                    "formed from a prompt's samples"
                )
        elif self.file and (trouble := formats.check_path(self.file)):
            problems.append(
                f"preference.file={self.file!r}: {trouble} (or {pairs.SAMPLE_AT_SETUP!r}, once "
                "'warm_start': pairs sampled at set-up from the warm start)"
            )
        return problems


def run(config, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) a preference run in `workdir`; returns the summary. `config`: the
    resolved run (`rl.resolve.RunConfig`)."""
    lp = loop.Loop(config, workdir, allow_config_change)
    s, run, comp, c = lp.s, lp.run, lp.comp, lp.config  # `c`: its prompt pool filled.
    source = pairs.PairSource(c.preference, c.batch, c.seed, s, lp.source, workdir)
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
