"""reasoning-gym's procedural generators as rlscale tasks: disjoint seeded splits materialized as
TFDS array_record files, graded by each generator's own `score_answer` (full credit by default).
Keys: docs/data.md.
"""

import dataclasses
import difflib
import hashlib
import importlib.metadata
import json
from collections.abc import Mapping

import numpy as np
import reasoning_gym
import reasoning_gym.utils
import tensorflow_datasets as tfds
from reasoning_gym import factory

from rlscale.data import builders, tasks

NAME = "reasoning_gym"  # config.task.name
TASK_KEYS = ("dataset", "config", "difficulty", "seed", "n_train", "n_test", "partial_credit")
ANSWER_FORMAT = "<answer>{}</answer>"
# Draws in a row that give no new problem (a repeat, or in test a train prompt) before giving
# up: the generator's problem space is (nearly) exhausted. A split draws at most
# 4 n + MAX_MISSES entries (the generator's `size`: some build them all up front).
MAX_MISSES = 2_000


@dataclasses.dataclass(frozen=True)
class GymProblem(tasks.Problem):
    """A reasoning-gym problem: prompt, gold answer, demonstration, and the generator's whole
    entry as JSON ({question, answer, metadata}), which `score_answer` reads."""

    entry: str = ""


def version() -> str:
    return importlib.metadata.version("reasoning-gym")


def generator_names() -> list[str]:
    return sorted(factory.DATASETS)


def _check_name(dataset: str) -> None:
    if dataset in factory.DATASETS:
        return
    near = difflib.get_close_matches(str(dataset), generator_names(), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise ValueError(
        f"task.dataset={dataset!r} is not a reasoning-gym generator{hint} "
        f"({len(factory.DATASETS)} generators: reasoning_gym.factory.DATASETS)"
    )


def _fields(dataset: str) -> list[str]:
    return [f.name for f in dataclasses.fields(factory.DATASETS[dataset][1])]


def generator_kwargs(dataset: str, difficulty: int, config: Mapping | None = None) -> dict:
    """The generator's config arguments for a difficulty and user settings (no seed, size).

    Raises:
      ValueError: naming an unknown generator (with near matches), a difficulty the generator
        has no curriculum for, a `config` key its dataclass lacks, or settings its own
        validation rejects.
    """
    _check_name(dataset)
    config = dict(config or {})
    if not isinstance(difficulty, int) or difficulty < 0:
        raise ValueError(f"task.difficulty={difficulty!r} must be an integer >= 0")
    kwargs = {}
    if difficulty > 0:
        if not factory.has_curriculum(dataset):
            raise ValueError(
                f"task.difficulty={difficulty}: reasoning-gym generator {dataset!r} has no "
                "curriculum; use difficulty 0 (its defaults) and task.config"
            )
        curriculum = factory.create_curriculum(dataset)
        for name, attr in curriculum.attributes.items():
            curriculum.set_attr_level(name, min(difficulty - 1, len(attr.levels) - 1))
        generated = curriculum.generate_configuration()
        # Shallow: a field may itself be a dataclass (rearc's, arc_agi's), kept as it is.
        kwargs = {f.name: getattr(generated, f.name) for f in dataclasses.fields(generated)}
    fields = _fields(dataset)
    unknown = sorted(set(config) - set(fields))
    if unknown or {"seed", "size"} & set(config):
        bad = unknown or sorted({"seed", "size"} & set(config))
        raise ValueError(
            f"task.config {bad} for reasoning-gym generator {dataset!r}: its config fields are "
            f"{', '.join(f for f in fields if f not in ('seed', 'size'))} (seed and size come "
            "from task.seed and task.n_train / task.n_test)"
        )
    kwargs.update(config)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("seed", "size")}
    try:  # The dataclass's own checks (asserts), so bad settings fail before any work.
        config_obj = factory.DATASETS[dataset][1](**kwargs, seed=0, size=1)
        if hasattr(config_obj, "validate"):
            config_obj.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(
            f"task.config for reasoning-gym generator {dataset!r} is invalid ({kwargs}): "
            f"{type(e).__name__}: {e}"
        ) from None
    return kwargs


def config_problems(t) -> list[str]:
    """Start-up checks of a `config.task` naming a reasoning-gym generator (`rl.checks`)."""
    missing = [f"task.{k}" for k in TASK_KEYS if k not in t]
    if missing:  # Another recipe's task switched over with --config.task.name=reasoning_gym.
        return [
            f"task.name={NAME!r} needs {', '.join(missing)} (configs/reasoning_gym.py sets "
            "every key)"
        ]
    problems = []
    if not hasattr(t.config, "to_dict"):
        problems.append(f"task.config={t.config!r} must be a dict of the generator's fields")
    else:
        try:
            generator_kwargs(t.dataset, t.difficulty, t.config.to_dict())
        except ValueError as e:
            problems.append(str(e))
    for key in ("n_train", "n_test"):
        if not isinstance(t[key], int) or t[key] < 1:
            problems.append(f"task.{key}={t[key]!r} must be an integer >= 1")
    if not isinstance(t.seed, int) or t.seed < 0:
        problems.append(f"task.seed={t.seed!r} must be an integer >= 0")
    if not isinstance(t.partial_credit, bool):
        problems.append(f"task.partial_credit={t.partial_credit!r} must be a boolean")
    return problems


def split_seed(seed: int, split: str) -> int:
    """The generator seed of a split: a hash of (seed, split) below 2**31, so the two splits'
    entry ranges (seed + index for most generators) are far apart."""
    h = hashlib.sha256(f"rlscale reasoning_gym {seed} {split}".encode()).digest()
    return int.from_bytes(h[:4], "little") >> 1


def _tag(x):
    """`x` with the values JSON would change made explicit: tuples (arc_agi compares grids as
    tuples), sets and dicts with keys that are not strings."""
    if isinstance(x, tuple):
        return {"__tuple__": [_tag(v) for v in x]}
    if isinstance(x, set | frozenset):
        return {"__set__": [_tag(v) for v in sorted(x, key=repr)]}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and not {"__tuple__", "__set__", "__items__"} & set(
            x
        ):
            return {k: _tag(v) for k, v in x.items()}
        return {"__items__": [[_tag(k), _tag(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return [_tag(v) for v in x]
    return x


def _untag(x):
    if isinstance(x, list):
        return [_untag(v) for v in x]
    if isinstance(x, dict):
        if len(x) == 1 and "__tuple__" in x:
            return tuple(_untag(v) for v in x["__tuple__"])
        if len(x) == 1 and "__set__" in x:
            return {_untag(v) for v in x["__set__"]}
        if len(x) == 1 and "__items__" in x:
            return {_untag(k): _untag(v) for k, v in x["__items__"]}
        return {k: _untag(v) for k, v in x.items()}
    return x


def entry_to_json(dataset: str, entry: dict) -> str:
    """A generator's entry as JSON text that `entry_from_json` turns back into an equal entry
    (tuples, sets and non-string keys included)."""
    try:
        return json.dumps(_tag(entry), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"reasoning-gym generator {dataset!r}: entry {str(entry.get('question'))[:60]!r} "
            f"cannot be stored as JSON: {e}"
        ) from None


def entry_from_json(text: str) -> dict:
    return _untag(json.loads(text))


def generate(
    dataset: str, kwargs: Mapping, seed: int, n_train: int, n_test: int
) -> dict[str, list[GymProblem]]:
    """{"train": [...], "test": [...]}: distinct problems, the test prompts disjoint from train.

    Raises:
      ValueError: when the generator runs out of distinct problems (`MAX_MISSES` draws in a
        row without a new one, or its `size`), naming the split and how many it found.
    """
    cls, config_cls = factory.DATASETS[dataset]
    out, train_prompts = {}, set()
    for split, n in (("train", n_train), ("test", n_test)):
        config = config_cls(**kwargs, seed=split_seed(seed, split), size=4 * n + MAX_MISSES)
        source = cls(config=config)
        seen, problems, misses, i = set(), [], 0, 0
        while len(problems) < n:
            if misses >= MAX_MISSES or i >= config.size:
                raise ValueError(
                    f"reasoning-gym generator {dataset!r} ({kwargs}) has fewer than {n} "
                    f"distinct {split} problems{' unseen in train' if split == 'test' else ''} "
                    f"(found {len(problems)}); lower task.n_{split} or raise task.difficulty"
                )
            entry = source[i]
            i += 1
            prompt = str(entry["question"])
            if prompt in seen or prompt in train_prompts:
                misses += 1
                continue
            misses = 0
            seen.add(prompt)
            # Generators whose problems have many solutions (sokoban, rubiks_cube, ...) have no
            # gold answer: no demonstration either (the SFT warm start cannot learn them).
            answer = "" if entry["answer"] is None else str(entry["answer"])
            problems.append(
                GymProblem(
                    prompt=prompt,
                    answer=answer,
                    demo=ANSWER_FORMAT.format(answer) if answer else "",
                    entry=entry_to_json(dataset, entry),
                )
            )
        out[split] = problems
        train_prompts = seen
    return out


# ------------------------------------------------------------------------------------------
# The TFDS builder.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GymConfig(tfds.core.BuilderConfig):
    dataset: str = "basic_arithmetic"
    difficulty: int = 0
    config_json: str = "{}"  # task.config as JSON.
    seed: int = 0
    n_train: int = 1000
    n_test: int = 200


class ReasoningGymTasks(tfds.core.GeneratorBasedBuilder):
    """One config per (generator, its settings, seed, sizes, reasoning-gym version)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [GymConfig(name="default")]

    def _info(self):
        return self.dataset_info_from_configs(
            description="reasoning-gym generators (rlscale.data.reasoning_gym_tasks).",
            disable_shuffling=True,  # Record i is problem i.
            features=tfds.features.FeaturesDict(
                {
                    "prompt": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "demo": tfds.features.Text(),
                    "entry": tfds.features.Text(),
                    "index": np.int64,
                }
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        c = self.builder_config
        kwargs = generator_kwargs(c.dataset, c.difficulty, json.loads(c.config_json))
        splits = generate(c.dataset, kwargs, c.seed, c.n_train, c.n_test)
        return {split: self._generate_examples(problems) for split, problems in splits.items()}

    def _generate_examples(self, problems):
        for i, p in enumerate(problems):
            yield i, {**dataclasses.asdict(p), "index": i}


def _kwargs_key(kwargs: Mapping) -> str:
    # repr for values JSON lacks (a nested config dataclass): deterministic for dataclasses.
    return json.dumps(dict(kwargs), sort_keys=True, default=repr)


def config_name(dataset: str, kwargs: Mapping, seed: int, n_train: int, n_test: int) -> str:
    """`{generator}_s{seed}_{n_train}_{n_test}_{digest}`: the digest covers the generator's
    settings and reasoning-gym's version (a new version may generate other problems)."""
    h = hashlib.sha256(f"{version()}\0{_kwargs_key(kwargs)}".encode())
    return f"{dataset}_s{seed}_{n_train}_{n_test}_{h.hexdigest()[:12]}"


def materialize(
    dataset: str,
    difficulty: int,
    n_train: int,
    n_test: int,
    data_dir: str,
    *,
    seed: int = 0,
    config: Mapping | None = None,
) -> dict:
    """Builds the dataset once (reused afterwards) and returns {split: data source}."""
    kwargs = generator_kwargs(dataset, difficulty, config)
    builder_config = GymConfig(
        name=config_name(dataset, kwargs, seed, n_train, n_test),
        dataset=dataset,
        difficulty=difficulty,
        config_json=json.dumps(dict(config or {}), sort_keys=True),
        seed=seed,
        n_train=n_train,
        n_test=n_test,
    )
    return builders.prepare(
        ReasoningGymTasks(data_dir=data_dir, config=builder_config, file_format="array_record")
    )


def decode(example: dict) -> GymProblem:
    """A data-source record as a GymProblem."""
    text = builders.text_fields(example)
    return GymProblem(
        prompt=text["prompt"], answer=text["answer"], demo=text["demo"], entry=text["entry"]
    )


def load(t, data_dir: str) -> tuple["GymTask", dict[str, list[GymProblem]]]:
    """(task, {split: problems}) for a `config.task` naming a reasoning-gym generator."""
    config = t.config.to_dict()
    sources = materialize(
        t.dataset, t.difficulty, t.n_train, t.n_test, data_dir, seed=t.seed, config=config
    )
    task = GymTask(t.dataset, generator_kwargs(t.dataset, t.difficulty, config), t.partial_credit)
    return task, {
        split: [decode(src[i]) for i in range(len(src))] for split, src in sources.items()
    }


# ------------------------------------------------------------------------------------------
# The task: verification with the generator's own scorer.
# ------------------------------------------------------------------------------------------

# Scorer instances per process, built on first use: the task pickles as names and settings
# only (it travels to the verifier pool's workers with each call).
_SCORERS: dict[str, object] = {}


def _scorer(dataset: str, kwargs: Mapping):
    key = f"{dataset}\0{_kwargs_key(kwargs)}"
    if key not in _SCORERS:
        cls, config_cls = factory.DATASETS[dataset]
        _SCORERS[key] = cls(config=config_cls(**kwargs, seed=0, size=1))
    return _SCORERS[key]


class GymTask:
    """The verifier side of a reasoning-gym generator, with the interface of `tasks.Task`.

    `verify(completion, problem)` extracts the last `<answer>...</answer>` and scores it with
    the generator's `score_answer` against the stored entry: 1.0 on full credit, else 0.0
    (or the score itself with `partial_credit`). No answer tags score 0. It runs in the RL
    loop's verifier pool like any verifier: a scorer that raises or hangs costs one sample.
    """

    name = NAME
    demo_stop = None  # Single-turn demonstrations (`tasks.demo_turns`).

    def __init__(self, dataset: str, kwargs: Mapping, partial_credit: bool = False):
        _check_name(dataset)
        self.dataset = dataset
        self.kwargs = dict(kwargs)
        self.partial_credit = partial_credit

    def verify(self, completion: str, problem: GymProblem) -> float:
        answer = self.extract_answer(completion)
        if answer is None:
            return 0.0
        score = float(
            _scorer(self.dataset, self.kwargs).score_answer(answer, entry_from_json(problem.entry))
        )
        return score if self.partial_credit else float(score >= 1.0)

    @staticmethod
    def extract_answer(completion: str) -> str | None:
        return reasoning_gym.utils.extract_answer(completion, tag_name="answer")
