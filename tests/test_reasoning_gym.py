"""reasoning-gym generators as tasks: reasoning-gym's own problems and scorer, disjoint
splits, TFDS materialization, bad settings, and smoke runs on two generators."""

import pickle
import sys

import numpy as np
import pytest
import reasoning_gym
from conftest import load_config, metric_lines

from rlscale.data import reasoning_gym_tasks as rgt
from rlscale.rewards import isolation

GENERATORS = ("basic_arithmetic", "spell_backward")


def _reference(name, kwargs, seed, n, exclude=frozenset()):
    """The first n distinct questions (not in `exclude`) of reasoning-gym's own dataset."""
    ds = reasoning_gym.create_dataset(name, **kwargs, seed=seed, size=10 * n)
    out = []
    for entry in ds:
        if entry["question"] not in exclude and entry["question"] not in {e[0] for e in out}:
            out.append((entry["question"], entry["answer"]))
        if len(out) == n:
            return out
    raise AssertionError("reference ran out of problems")


def test_difficulty_is_the_curriculum_level():
    # basic_arithmetic's curriculum at level 0 (reasoning-gym's definition): 2 terms of 1 digit.
    kwargs = rgt.generator_kwargs("basic_arithmetic", 1)
    assert (kwargs["min_terms"], kwargs["max_terms"]) == (2, 2)
    assert (kwargs["min_digits"], kwargs["max_digits"]) == (1, 1)
    # Level 1 spans levels 0-1 (inclusive mode): 2-3 terms of 1-2 digits; config wins.
    kwargs = rgt.generator_kwargs("basic_arithmetic", 2, {"max_terms": 4})
    assert (kwargs["min_terms"], kwargs["max_terms"]) == (2, 4)
    assert (kwargs["min_digits"], kwargs["max_digits"]) == (1, 2)
    assert rgt.generator_kwargs("basic_arithmetic", 0) == {}  # The generator's defaults.


@pytest.mark.parametrize("name", GENERATORS)
def test_problems_are_reasoning_gyms_disjoint_and_scored_by_its_scorer(name):
    kwargs = rgt.generator_kwargs(name, 1)
    splits = rgt.generate(name, kwargs, seed=0, n_train=150, n_test=30)
    train, test = splits["train"], splits["test"]
    assert splits == rgt.generate(name, kwargs, seed=0, n_train=150, n_test=30)
    # Each split is reasoning-gym's own stream for the split's seed, deduplicated, and the
    # test split skips every train prompt.
    ref_train = _reference(name, kwargs, rgt.split_seed(0, "train"), 150)
    assert [(p.prompt, p.answer) for p in train] == ref_train
    exclude = frozenset(q for q, _ in ref_train)
    ref_test = _reference(name, kwargs, rgt.split_seed(0, "test"), 30, exclude)
    assert [(p.prompt, p.answer) for p in test] == ref_test
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert rgt.split_seed(0, "train") != rgt.split_seed(0, "test")

    task = rgt.GymTask(name, kwargs)
    scorer = reasoning_gym.create_dataset(name, **kwargs, seed=1, size=1)
    for p in train[:20] + test[:10]:
        entry = rgt.entry_from_json(p.entry)
        assert p.demo == f"<answer>{p.answer}</answer>"
        assert task.verify(p.demo, p) == 1.0 == scorer.score_answer(p.answer, entry)
        assert task.verify(p.answer, p) == 0.0  # No answer tags: nothing to score.
        wrong = p.answer + "x9"  # Contains the gold: reasoning-gym gives partial credit.
        partial = scorer.score_answer(wrong, entry)
        assert 0.0 < partial < 1.0
        assert task.verify(f"<answer>{wrong}</answer>", p) == 0.0
        partial_task = rgt.GymTask(name, kwargs, partial_credit=True)
        assert partial_task.verify(f"<answer>{wrong}</answer>", p) == partial


def test_entries_keep_what_json_would_change():
    entry = {"answer": "1", "metadata": {"grid": ((1, 2), (3,)), "ids": {7}, "by_n": {3: "a"}}}
    assert rgt.entry_from_json(rgt.entry_to_json("x", entry)) == entry
    back = rgt.entry_from_json(rgt.entry_to_json("x", entry))
    assert isinstance(back["metadata"]["grid"][0], tuple)
    with pytest.raises(ValueError, match="'x': entry .* cannot be stored as JSON"):
        rgt.entry_to_json("x", {"question": "q", "metadata": {"f": object()}})


def test_a_failing_scorer_costs_one_sample_and_the_task_pickles():
    kwargs = rgt.generator_kwargs("basic_arithmetic", 1)
    problems = rgt.generate("basic_arithmetic", kwargs, seed=0, n_train=3, n_test=1)["train"]
    task = pickle.loads(pickle.dumps(rgt.GymTask("basic_arithmetic", kwargs)))
    broken = rgt.GymProblem(prompt="Q", answer="1", demo="<answer>1</answer>", entry="{}")
    rewards, failures = isolation.score_isolated(
        task.verify, [p.demo for p in problems] + [broken.demo], [*problems, broken]
    )
    np.testing.assert_array_equal(rewards, [1.0, 1.0, 1.0, 0.0])  # The scorer's KeyError.
    assert failures["error"] == 1


def test_materialized_like_the_synthetic_tasks(tmp_path):
    sources = rgt.materialize("spell_backward", 1, n_train=40, n_test=10, data_dir=str(tmp_path))
    kwargs = rgt.generator_kwargs("spell_backward", 1)
    expected = rgt.generate("spell_backward", kwargs, seed=0, n_train=40, n_test=10)
    for split in ("train", "test"):
        assert [rgt.decode(sources[split][i]) for i in range(len(sources[split]))] == (
            expected[split]
        )
    again = rgt.materialize("spell_backward", 1, n_train=40, n_test=10, data_dir=str(tmp_path))
    assert rgt.decode(again["train"][7]) == expected["train"][7]
    assert list(tmp_path.rglob("*.array_record*"))
    assert "tensorflow" not in sys.modules


def test_bad_settings_are_named():
    with pytest.raises(
        ValueError,
        match=r"'basic_arithmetc' is not a reasoning-gym generator; "
        r"did you mean basic_arithmetic",
    ):
        rgt.generator_kwargs("basic_arithmetc", 1)
    with pytest.raises(ValueError, match=r"task.config \['max_word'\] .* fields are .*max_words"):
        rgt.generator_kwargs("letter_counting", 1, {"max_word": 3})
    with pytest.raises(ValueError, match="'acre' has no curriculum"):
        rgt.generator_kwargs("acre", 1)
    with pytest.raises(ValueError, match="task.config for .*'chain_sum' is invalid.*max_terms"):
        rgt.generator_kwargs("chain_sum", 0, {"min_terms": 5, "max_terms": 2})
    with pytest.raises(ValueError, match="'coin_flip' .* fewer than 20 distinct train problems"):
        rgt.generate("coin_flip", rgt.generator_kwargs("coin_flip", 1), 0, 20, 5)
    # At start-up, with the run's other problems.
    from rlscale import rl

    config = load_config("reasoning_gym")
    config.task.dataset = "letter_countin"
    config.task.n_test = 0
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "did you mean letter_counting" in str(e.value)
    assert "task.n_test=0 must be an integer >= 1" in str(e.value)
    # Another recipe's task switched over from the command line: the keys it lacks.
    config = load_config("quickstart")
    config.task.name = "reasoning_gym"
    with pytest.raises(ValueError, match=r"'reasoning_gym' needs task.dataset, task.config, "):
        rl.resolve(config)


@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATORS[:1])
def test_smoke_run(name, tmp_path):
    """`configs/reasoning_gym.py:smoke` with `--config.task.dataset=NAME`: tokenizer, SFT on
    the answers, RL scored by the generator's scorer in the verifier pool. One generator: the
    others' problems and scoring are tested above, and the run does not depend on which."""
    from rlscale import rl

    config = load_config("reasoning_gym")
    config.task.dataset = name
    config.mesh.shape = (1, 1, 1)
    config.reward.workers = 1 if name == GENERATORS[0] else 0
    config.sft.eval_every = config.sft.max_steps  # Its held-out pass@1 once, at the end.
    # Two of the recipe's four layers: the run takes 40% less CPU time (compiling is most of
    # it), and 20 SFT steps teach the answer format as well (credit in training and eval).
    config.model.num_layers = 2
    summary = rl.run(rl.resolve(config), str(tmp_path))
    lines = metric_lines(tmp_path)
    assert [x["step"] for x in lines if "eval/pass@1" in x] == [0, 2, 3]
    train = [x for x in lines if "reward/failures_error" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    assert all(x["reward/failures_error"] == x["reward/failures_timeout"] == 0 for x in train)
    assert summary["sft/steps"] == config.sft.max_steps
    if name == "basic_arithmetic":  # The generator's scorer gave credit through the pool.
        credited = [x["train/reward_mean"] for x in train] + [
            x["eval/pass@1"] for x in lines if "eval/pass@1" in x
        ]
        assert max(credited) > 0
    assert (tmp_path / "data" / "reasoning_gym_tasks").is_dir()
