"""Local math datasets: formats, gold extraction, validation errors, caching, prompts."""

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlscale.data import formats, math_data
from rlscale.rewards import isolation
from rlscale.rewards import math as math_reward
from rlscale.tokenizers import chat

N = 20
INSTRUCTION = math_data.DEFAULT_INSTRUCTION


def gsm8k_rows():
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 3}. How many?", "answer": f"{i}+{i + 3}"}
        for i in range(N)
    ]
    for i, row in enumerate(rows):
        row["answer"] += f" = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3}\n#### {2 * i + 3}"
    rows[5]["answer"] = "Big numbers.\n#### 1,234,567"
    rows[6]["answer"] = "A #### inside, then the real one\n####  -8 "
    return rows


def math_rows():
    rows = [
        {"problem": f"Compute {i}/2.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$."}
        for i in range(N)
    ]
    rows[1]["solution"] = "First \\boxed{1}, then \\boxed{\\left\\{ 1, 2 \\right\\}} wins."
    rows[2]["solution"] = "Framed: $\\fbox{7}$"
    rows[3]["solution"] = "Unbraced: $\\boxed 5$."
    rows[4]["answer"] = "\\dfrac{3}{4}"  # The answer field wins over the box.
    rows[5]["unique_id"] = "test/algebra/5.json"
    return rows


def polaris_rows(numeric=False):
    rows = [{"problem": f"Find x if x - {i} = 0.", "answer": str(i)} for i in range(N)]
    if numeric:
        rows[7]["answer"] = 7  # JSON numbers are taken as their string.
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_gsm8k_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows())
    sources = math_data.materialize(str(path), "gsm8k", str(tmp_path / "data"))
    assert list(sources) == ["train"] and len(sources["train"]) == N
    problems = math_data.problems(sources["train"])
    rows = gsm8k_rows()
    assert [p.prompt for p in problems] == [f"{r['question']}\n{INSTRUCTION}" for r in rows]
    golds = [p.answer for p in problems]
    assert golds[:5] == ["3", "5", "7", "9", "11"]
    assert golds[5:7] == ["1234567", "-8"]
    assert [p.source for p in problems][:2] == ["gsm8k.jsonl:1", "gsm8k.jsonl:2"]
    assert all(p.id == "" for p in problems)
    # No demonstration in the file: the gold in the math verifier's format.
    assert problems[0].demo == "\\boxed{3}" and problems[0].verifier == "math"


def test_math_jsonl_gold_extraction(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", math_rows())
    problems = math_data.load(str(path), "math", str(tmp_path / "data"))["train"]
    golds = [p.answer for p in problems]
    assert golds[0] == "\\frac{0}{2}"
    assert golds[1] == "\\left\\{ 1, 2 \\right\\}"  # The last box, escaped braces kept.
    assert golds[2:5] == ["7", "5", "\\dfrac{3}{4}"]
    assert golds[19] == "\\frac{19}{2}"
    assert problems[5].id == "test/algebra/5.json" and problems[5].source == "math.jsonl:6"


def test_polaris_parquet(tmp_path):
    path = write_parquet(tmp_path / "polaris.parquet", polaris_rows())
    problems = math_data.load(str(path), "polaris", str(tmp_path / "data"))["train"]
    assert [p.answer for p in problems] == [str(i) for i in range(N)]
    assert problems[3].source == "polaris.parquet:row3"


def test_prompts_are_formatted_at_read_time_with_the_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", polaris_rows(numeric=True))
    source = math_data.materialize({"test": str(path)}, "polaris", str(tmp_path / "data"))["test"]
    assert math_data.problems(source)[7].answer == "7"
    user = f"Find x if x - 2 = 0.\n{INSTRUCTION}"
    qwen = math_data.problems(source, chat.get("qwen2.5"))
    assert qwen[2].prompt == chat.qwen2_5([{"role": "user", "content": user}])
    think_off = math_data.problems(source, chat.get("qwen3"), enable_thinking=False, system="S")
    assert think_off[2].prompt == chat.qwen3(
        [{"role": "system", "content": "S"}, {"role": "user", "content": user}],
        enable_thinking=False,
    )
    bare = math_data.problems(source, instruction=None)
    assert bare[2].prompt == "Find x if x - 2 = 0."


def test_materializing_twice_reuses_the_cache(tmp_path, monkeypatch):
    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows())
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows()[:7])
    files, data_dir = {"train": str(train), "test": str(test)}, str(tmp_path / "data")
    first = math_data.materialize(files, "gsm8k", data_dir)
    assert (len(first["train"]), len(first["test"])) == (N, 7)
    built = {
        os.path.join(d, f): os.path.getmtime(os.path.join(d, f))
        for d, _, fs in os.walk(data_dir)
        for f in fs
    }

    def no_reading(*args):
        raise AssertionError("the cached dataset should be reused, not rebuilt")

    monkeypatch.setattr(formats, "read_rows", no_reading)
    second = math_data.materialize(files, "gsm8k", data_dir)
    assert math_data.problems(second["test"]) == math_data.problems(first["test"])
    assert {p: os.path.getmtime(p) for p in built} == built
    # An edited file is a new dataset.
    monkeypatch.undo()
    write_jsonl(test, gsm8k_rows()[:9])
    assert len(math_data.materialize(files, "gsm8k", data_dir)["test"]) == 9


def _bad(rows, index, change):
    rows = [dict(r) for r in rows]
    change(rows[index])
    return rows


BAD_JSONL = [
    ("gsm8k", gsm8k_rows(), "line 4: bad JSON"),
    ("gsm8k", _bad(gsm8k_rows(), 3, lambda r: r.pop("question")), "missing field 'question'"),
    ("gsm8k", _bad(gsm8k_rows(), 3, lambda r: r.update(answer="42")), "no '####'"),
    ("gsm8k", _bad(gsm8k_rows(), 3, lambda r: r.update(answer="x ####  ")), "is empty"),
    ("math", _bad(math_rows(), 3, lambda r: r.update(solution="no box")), "no \\boxed"),
    ("math", _bad(math_rows(), 3, lambda r: r.update(solution="\\boxed{1")), "unbalanced"),
    ("math", _bad(math_rows(), 3, lambda r: r.update(solution="\\boxed{ }")), "is empty"),
    ("math", _bad(math_rows(), 3, lambda r: r.update(answer="")), "'answer' is empty"),
    ("polaris", _bad(polaris_rows(), 3, lambda r: r.update(answer=None)), "missing field"),
    ("polaris", _bad(polaris_rows(), 3, lambda r: r.update(problem=[1])), "must be a string"),
    ("polaris", polaris_rows()[:3] + [[1, 2]], "must be a JSON object"),
]


@pytest.mark.parametrize("fmt, rows, message", BAD_JSONL)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, fmt, rows, message):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in rows]
    if message.endswith("bad JSON"):
        lines[3] = lines[3][:-5]  # Truncated mid-object.
    path.write_text("\n".join(lines) + "\n")
    data_dir = tmp_path / "data"
    pattern = re.escape(f"{path}, line 4: ") + ".*" + re.escape(message.split(": ")[-1])
    with pytest.raises(ValueError, match=pattern):
        math_data.materialize(str(path), fmt, str(data_dir))
    # Nothing half-built is left to be reused.
    assert not list(data_dir.rglob("*array_record*"))


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    lines = [json.dumps(r).encode() for r in polaris_rows()]
    lines[8] = '{"problem": "caf\u00e9", "answer": "1"}'.encode("latin-1")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 9: not UTF-8")):
        math_data.materialize(str(path), "polaris", str(tmp_path / "data"))


def test_malformed_parquet_row_names_the_row_index(tmp_path):
    rows = _bad(polaris_rows(), 12, lambda r: r.update(answer="  "))
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=re.escape(f"{path}, row index 12: field 'answer'")):
        math_data.materialize(str(path), "polaris", str(tmp_path / "data"))


def test_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", polaris_rows())
    with pytest.raises(ValueError, match="unknown dataset format 'aime'"):
        math_data.materialize(str(path), "aime", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        math_data.materialize(str(tmp_path / "missing.jsonl"), "polaris", str(tmp_path))
    csv = tmp_path / "x.csv"
    csv.write_text("problem,answer\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        math_data.materialize(str(csv), "polaris", str(tmp_path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        math_data.materialize(str(empty), "polaris", str(tmp_path))


@pytest.mark.parametrize(
    "solution, gold",
    [
        ("$\\boxed{\\frac{a}{b}}$", "\\frac{a}{b}"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\boxed{\\{1\\}} and \\fbox{2}", "2"),
        ("\\boxed 12$ and more", "12"),
        ("\\boxed{1} then \\boxed{2", None),  # The last box decides, even when malformed.
        ("\\boxedx{1}", None),
        ("no box", None),
    ],
)
def test_boxed_answer(solution, gold):
    assert formats.boxed_answer(solution) == gold


def test_gsm8k_gold():
    assert formats.gsm8k_gold("so #### 1,000") == "1000"
    assert formats.gsm8k_gold("no marker") is None


def test_math_task_verifies_with_the_math_verifier():
    task = math_data.MathTask()
    problem = math_data.MathProblem(prompt="p", answer="\\frac{1}{2}", demo="")
    good = "<think>\nhalf\n</think>\n\nThe answer is $\\boxed{0.5}$."
    bad = "<think>\nhalf\n</think>\n\n\\boxed{2}"
    assert task.verify(good, problem) == 1.0
    assert task.verify(bad, problem) == 0.0
    assert task.extract_answer(good) == "0.5"


def test_math_task_in_the_reward_pool_bounds_adversarial_answers():
    """`MathTask.verify` as the RL loop runs it: in `verifier_pool` workers with the math
    verifier's deadline, where a power tower is cut off and scores 0."""
    task = math_data.MathTask()
    problem = math_data.MathProblem(prompt="p", answer="Tom has 7.\n#### 1,234", demo="")
    correct = "He buys 1200 more, so 1234.\nThe answer is 1,234."
    wrong = "He buys 1000 more.\nThe answer is 1034."
    tower = "So it is $\\boxed{9^{9^{9^{9}}}}$."
    timeout = math_reward.DEFAULT_TIMEOUT
    with isolation.verifier_pool(2) as pool:
        # A fresh worker's first check imports math-verify and builds its parser (the RL loop
        # pays this once per worker): warm both, so that only the tower meets the deadline.
        isolation.score_isolated(task.verify, [correct] * 2, [problem] * 2, pool=pool, timeout=60)
        rewards, failures = isolation.score_isolated(
            task.verify, [correct, wrong, tower], [problem] * 3, pool=pool, timeout=timeout
        )
    np.testing.assert_array_equal(rewards, [1.0, 0.0, 0.0])
    # The tower was cut off at its deadline: math-verify would evaluate it for minutes.
    assert failures == {"error": 0, "nonfinite": 0, "timeout": 1, "crash": 0}
