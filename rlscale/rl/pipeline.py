"""The pipeline driver (PipelineRL, async PPO): a generator thread decodes while the trainer
updates, with staleness bounded by admission control (no token trained more than
`pipeline.max_staleness` updates after the version that sampled it). See docs/pipeline.md.
"""

import dataclasses
import threading
import time
from typing import ClassVar

import jax

from rlscale import sections, sharding
from rlscale.data import filters
from rlscale.rl import loop, report

MODES = ("sync", "pipeline", "async_ppo")


@dataclasses.dataclass(frozen=True)
class PipelineConfig(sections.Section):
    """`config.pipeline`: "sync" samples each batch with the current policy, then trains on
    it; "pipeline" generates continuously with in-flight weight updates; "async_ppo"
    generates each batch with one policy version. No token is trained more than
    `max_staleness` updates after the version that sampled it. The generator gets the first
    `generator_devices` devices (0: it time-slices the trainer's), split `generator_tensor`
    ways tensor parallel (the rest data parallel over its slots; with shared devices, 1
    splits it over the trainer's own tensor axis and t > 1 sees the trainer's devices again
    as a (devices / t, 1, t) mesh: `sharding.role_meshes`), `slots` decode slots
    (resolved: 0 becomes batch.prompts x the completions per prompt) and runs `decode_chunk`
    tokens per call between weight and admission checks."""

    MODES: ClassVar[tuple] = MODES
    mode: str = "sync"
    max_staleness: int = 0
    generator_devices: int = 0
    generator_tensor: int = 1
    slots: int = 0
    decode_chunk: int = 8

    def problems(self) -> list[str]:
        if self.mode not in MODES:
            return [f"pipeline.mode={self.mode!r} is not one of {MODES}"]
        problems = sections.at_least("pipeline.max_staleness", self.max_staleness, 0)
        problems += sections.at_least("pipeline.decode_chunk", self.decode_chunk, 1)
        if self.mode == "sync" and (self.max_staleness or self.generator_devices):
            problems.append(
                "pipeline.mode='sync' generates each batch with the current policy on the "
                "trainer's devices: pipeline.max_staleness and pipeline.generator_devices "
                "must be 0"
            )
        g = self.generator_devices
        if not isinstance(g, int) or g < 0:
            problems.append(f"pipeline.generator_devices={g!r} must be an integer >= 0 (0: share)")
        return problems + self._tensor_problems()

    def _tensor_problems(self) -> list[str]:
        """`generator_tensor` against `generator_devices` (the heads it splits: `rl.checks`)."""
        g, t = self.generator_devices, self.generator_tensor
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            return [f"pipeline.generator_tensor={t!r} must be an integer >= 1 (1: no tensor axis)"]
        if not isinstance(g, int) or g <= 0 or t == 1:
            return []  # Shared devices: the mesh check (`rl.checks`) divides them.
        if g % t:
            return [
                f"pipeline.generator_tensor={t} does not divide pipeline.generator_devices={g}: "
                "the generator's mesh is (generator_devices / generator_tensor, 1, "
                "generator_tensor)"
            ]
        return []


class Feed(threading.Thread):
    """The generator thread: batches `first`..`last`, generated and scored, handed over by
    `take`; weights arrive by `publish`."""

    def __init__(self, s, source, stream, rng, first: int, last: int):
        super().__init__(name="rlscale-generator", daemon=True)
        p = s.config.pipeline
        # The engine, driven through the run's environments (`envs.episodes`).
        self.gen, self.source, self.stream, self.rng = s.episodes, source, stream, rng
        self.mode, self.chunk = p.mode, p.decode_chunk
        u = s.config.learner
        self.ahead = p.max_staleness // (u.epochs * u.minibatches)  # Batches of lead.
        self.next_batch, self.last = first, last
        self.cv = threading.Condition()
        self.published = None  # (params, version, batches trained, publication number)
        self.taken = -1  # The publication the engine samples with,
        self.taken_trained = 0  # and the batches trained before it.
        self.pending: dict[int, dict] = {}  # Batch -> ids, stream state, completed requests.
        self.ready: dict[int, dict] = {}  # Batch -> ids, stream state, scored samples.
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    # -- the trainer's side ----------------------------------------------------------------

    def publish(self, params, version: int, trained: int) -> None:
        with self.cv:
            number = 0 if self.published is None else self.published[3] + 1
            self.published = (params, version, trained, number)
            self.cv.notify_all()

    def take(self, batch: int) -> tuple[dict, float]:
        """Batch `batch`, scored; and the seconds the trainer waited for it."""
        t = time.perf_counter()
        with self.cv:
            while batch not in self.ready:
                if self.error is not None:
                    raise RuntimeError("the generator thread failed") from self.error
                if not self.is_alive():
                    raise RuntimeError("the generator thread stopped")
                self.cv.wait(0.1)
            return self.ready.pop(batch), time.perf_counter() - t

    def judge(self, ids, samples) -> dict:
        """`RolloutSource.judge` under the lock the generator reads retired prompts under."""
        with self.cv:
            return self.source.judge(ids, samples)

    def stop(self) -> None:
        self.stopping.set()
        with self.cv:
            self.cv.notify_all()
        self.join()

    # -- the generator's side --------------------------------------------------------------

    def run(self):
        try:
            while not self.stopping.is_set():
                self._take_weights()
                self._admit()
                if self.gen.busy:
                    for c in self.gen.step(self.chunk).completed:
                        self._completed(c)
                else:
                    with self.cv:
                        self.cv.wait(0.05)
        except BaseException as e:  # Reported to the trainer by `take`.
            self.error = e
            with self.cv:
                self.cv.notify_all()

    def _take_weights(self):
        with self.cv:
            pub = self.published
        if pub is None or pub[3] == self.taken:
            return
        if self.mode == "async_ppo" and self.gen.busy:
            return  # A batch is generated by one version: new weights wait for it to finish.
        self.gen.set_params(pub[0], pub[1])
        self.taken, self.taken_trained = pub[3], pub[2]

    def _admit(self):
        if self.taken < 0:
            return
        # Counted from the weights the engine holds, not the newest published: a batch
        # admitted now samples with those at the oldest.
        trained = self.taken_trained
        while self.next_batch <= self.last and self.next_batch - 1 - trained <= self.ahead:
            if self.mode == "async_ppo" and (self.gen.busy or self.taken != self.published[3]):
                return
            b = self.next_batch
            with self.cv:
                retired = set(self.source.history.retired)
            ids = self.stream.next(self.source.B, retired)
            rng = jax.random.fold_in(jax.random.fold_in(self.rng, b), 0)  # Round 0 of step b.
            self.pending[b] = {"ids": ids, "stream": self.stream.state(), "completed": []}
            self.source.submit(ids, rng, tag=b)
            self.next_batch += 1

    def _completed(self, episode):
        b = episode.request.id[0]
        entry = self.pending[b]
        entry["completed"].append(episode)
        if len(entry["completed"]) == len(entry["ids"]):
            del self.pending[b]
            samples = self.source.score(entry["completed"], entry["ids"])
            with self.cv:
                self.ready[b] = {"ids": entry["ids"], "stream": entry["stream"], "samples": samples}
                self.cv.notify_all()


def run(config, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) the RL loop in pipeline or async_ppo mode (`config`: the resolved
    run, `rl.resolve.RunConfig`); returns the summary."""
    lp = loop.Loop(config, workdir, allow_config_change)
    s, run, source, comp = lp.s, lp.run, lp.source, lp.comp
    trainer_devices, generator_devices = s.mesh.devices.size, s.generator_mesh.devices.size
    k = config.pipeline.max_staleness
    # The generator draws prompts ahead of the trainer from its own copy of the stream.
    ahead_stream = filters.PromptStream.from_state(run.stream.state())
    feed = Feed(s, source, ahead_stream, run.rng, lp.start + 1, config.steps)
    engine = s.generator.stats

    def publish(trained):
        params, reshard_s = s.generator_params(run.train.params)
        feed.publish(params, int(sharding.fetch(run.train.step)), trained)
        return reshard_s

    with lp.running() as cleanup:
        publish(lp.start)
        feed.start()
        cleanup.callback(feed.stop)
        seen = dataclasses.replace(engine)
        for step in range(lp.start + 1, config.steps + 1):
            t_wait = time.time()
            batch, wait_s = feed.take(step)
            t_update = time.time()
            version = int(sharding.fetch(run.train.step))
            roll, stats = source.rollouts([feed.judge(batch["ids"], batch["samples"])])
            lag = report.staleness(roll, version)
            if lag["pipeline/staleness_max"] > k:  # Admission control makes this impossible.
                raise RuntimeError(
                    f"step {step}: a token {lag['pipeline/staleness_max']} updates stale was "
                    f"about to be trained (pipeline.max_staleness={k})"
                )
            train, mets, applied = s.learner.update(run.train, s.ref_params, roll, step)
            run.train = jax.block_until_ready(train)
            run.stream = filters.PromptStream.from_state(batch["stream"])
            t_done = time.time()
            reshard_s = publish(step)
            comp.add_step(s.model_cfg, stats, roll, s.learner.forward_passes)
            now = dataclasses.replace(engine)
            generator = report.generator_record(seen, now)
            seen = now
            comp.add_seconds(t_done - t_update + reshard_s, trainer_devices)
            comp.add_seconds(generator["time/generator_busy_s"], generator_devices)
            step_s = time.time() - t_wait
            times = {
                "time/sample_s": wait_s,
                "time/update_s": t_done - t_update,
                "time/reshard_s": reshard_s,
                "time/step_s": step_s,
                "time/trainer_idle_frac": wait_s / max(step_s, 1e-9),
            }
            record = lp.record(step, stats, mets, applied, times)
            record.update({**lag, **generator})
            lp.end_step(step, record)
    return lp.finish()
