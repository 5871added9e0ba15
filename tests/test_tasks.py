"""Synthetic tasks: determinism, disjoint splits, exact verifiers, TFDS materialization."""

import sys

import pytest

from rlscale.data import builders, tasks


@pytest.mark.parametrize(
    "name,difficulty",
    [
        ("arithmetic", 1),
        ("arithmetic", 3),
        ("long_arithmetic", 3),
        ("countdown", 2),
        ("countdown", 3),
    ],
)
def test_deterministic_disjoint_and_demos_verify(name, difficulty):
    task = tasks.get(name, difficulty)
    n = 100 if difficulty < 3 else 300
    train = list(task.problems("train", n))
    test = list(task.problems("test", 20))
    assert train == list(tasks.get(name, difficulty).problems("train", n))
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.prompt for p in train}) == n
    assert all(task.verify(p.demo, p) == 1.0 for p in train + test)


def test_arithmetic_verifier_hand_cases():
    task = tasks.get("arithmetic", 2)
    p = tasks.Problem(prompt="Q: 3-5*6=", answer="-27", demo="3-30=-27 Answer: -27")
    assert task.verify("3-30=-27 Answer: -27", p) == 1.0
    assert task.verify("Answer: -27", p) == 1.0
    assert task.verify("Answer: 27", p) == 0.0  # Sign matters.
    assert task.verify("-27", p) == 0.0  # No "Answer:" line: fail closed.
    assert task.verify("Answer: -27 Answer: 5", p) == 0.0  # The last answer counts.
    assert task.verify("Answer: -27.0", p) == 0.0


def test_arithmetic_demo_takes_one_operation_per_step():
    task = tasks.get("arithmetic", 3)
    p = task._sample(_FixedRng([7, 5, 3, 2], ["+", "*", "-"]))
    assert p.prompt == "Q: 7+5*3-2="
    assert p.demo == "7+15-2=22-2=20 Answer: 20"
    assert tasks.without_answer_line(p) == "7+15-2=22-2=20"
    assert task.verify(tasks.without_answer_line(p), p) == 0.0


def test_long_arithmetic_draws_its_operators_per_problem():
    """difficulty to 2 x difficulty operators, each count drawn, so completions are long and
    of unequal lengths; no product of three numbers; otherwise arithmetic's problems, worked
    the same way."""
    task = tasks.get("long_arithmetic", 4)
    problems = list(task.problems("train", 400))
    ops = [tasks.parse_expression(p.prompt[3:-1])[1] for p in problems]
    assert {len(o) for o in ops} == set(range(4, 9))
    assert [p.demo.count("=") + 1 for p in problems] == [len(o) for o in ops]  # A step an op.
    assert not any(a == b == "*" for o in ops for a, b in zip(o, o[1:]))
    assert any("*" in o for o in ops)
    lengths = [len(p.demo) for p in problems]
    assert min(lengths) < 60 and max(lengths) > 100
    p = task._sample(_FixedRng([7, 5, 3, 2], ["+", "*", "-"], count=3))
    assert p.demo == "7+15-2=22-2=20 Answer: 20"
    p = task._sample(_FixedRng([7, 5, 3, 2], ["*", "*", "-"], count=3))
    assert p.prompt == "Q: 7*5+3-2=" and p.answer == "36"  # The second * redrawn.


class _FixedRng:
    """Stands in for np.random.Generator: returns scripted numbers, then operators."""

    def __init__(self, numbers, ops, count=None):
        self.numbers, self.ops, self.count = numbers, ops, count

    def integers(self, low, high, size=None):
        del low, high
        return self.count if size is None else self.numbers

    def choice(self, options, size=None):
        return options[0] if size is None else self.ops


def test_countdown_verifier_hand_cases():
    task = tasks.get("countdown", 3)
    p = tasks.Problem(prompt="Q: reach 22 with 3 5 7=", answer="22", demo="3*5+7 Answer: 22")
    assert task.verify("3*5+7 Answer: 22", p) == 1.0
    assert task.verify("7+3*5 Answer: 22", p) == 1.0  # Another valid solution.
    assert task.verify("7+3*5", p) == 0.0  # No "Answer:" line: fail closed.
    assert task.verify("3*5+7 Answer: 21", p) == 0.0  # The stated answer must be the target.
    assert task.verify("3*5+7+0 Answer: 22", p) == 0.0  # 0 is not an input.
    assert task.verify("7+7+3+5 Answer: 22", p) == 0.0  # 7 used twice.
    assert task.verify("3*5+6 Answer: 22", p) == 0.0
    assert task.verify("__import__('os') Answer: 22", p) == 0.0  # Parsed, never evaluated.
    assert tasks.evaluate(*tasks.parse_expression("2+3*4-5")) == 9


def test_tfds_materialization_without_tensorflow(tmp_path):
    sources = builders.materialize("arithmetic", 2, n_train=50, n_test=10, data_dir=str(tmp_path))
    assert len(sources["train"]) == 50 and len(sources["test"]) == 10
    expected = list(tasks.get("arithmetic", 2).problems("test", 10))
    assert [builders.decode(sources["test"][i]) for i in range(10)] == expected
    again = builders.materialize("arithmetic", 2, n_train=50, n_test=10, data_dir=str(tmp_path))
    assert builders.decode(again["train"][7]) == builders.decode(sources["train"][7])
    assert list(tmp_path.rglob("*.array_record*"))
    assert "tensorflow" not in sys.modules


def test_bad_task_arguments():
    with pytest.raises(ValueError, match="unknown task 'sudoku'"):
        tasks.get("sudoku", 1)
    with pytest.raises(ValueError, match="difficulty=0"):
        tasks.get("arithmetic", 0)
    with pytest.raises(ValueError, match="fewer than 500 distinct test problems"):
        list(tasks.get("countdown", 1).problems("test", 500))


def test_a_stale_warm_start_is_refused(tmp_path):
    """A cached warm start made with other settings is refused, the differences listed, not
    silently reused."""
    from rlscale import config_lib, rl, stage_cache, warm_start
    from rlscale.rl import setup

    config = config_lib.rl_config()
    made = setup.stage_settings(rl.resolve(config))[stage_cache.WARM_START]
    stage_cache.begin(str(tmp_path), stage_cache.WARM_START)
    stage_cache.complete(str(tmp_path), stage_cache.WARM_START, made, {})
    config.sft.answer_line_fraction = 1.0
    run = rl.resolve(config)
    inputs = setup.stage_settings(run)[stage_cache.WARM_START]
    with pytest.raises(ValueError, match="sft.answer_line_fraction: 0.25 -> 1.0"):
        warm_start.train_or_load(
            run.sft, run.eval, run.sampling, inputs, str(tmp_path), None, None, None, None, [], []
        )
