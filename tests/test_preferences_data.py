"""Preference pairs (`rlscale.data.preferences`): files as users write them, bad rows named by
file and line, ties dropped and said once, and pairs formed from scored samples by hand."""

import json
import logging

import numpy as np
import pytest

from rlscale.data import preferences
from rlscale.data.preferences import Pair


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _row(prompt, chosen, rejected, **extra):
    return json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra})


def test_reads_pairs_in_file_order_with_their_lines(tmp_path):
    path = _write(
        tmp_path / "train.jsonl",
        [_row("Q1", "good", "bad", score=1), "", _row("", "a", "b"), _row("Q3", "x", "")],
    )
    pairs = preferences.read_pairs(path)
    assert pairs == [Pair("Q1", "good", "bad"), Pair("", "a", "b"), Pair("Q3", "x", "")]
    # The blank line 2 holds no row, so the second pair is on line 3.
    assert [p.source for p in pairs] == ["train.jsonl:1", "train.jsonl:3", "train.jsonl:4"]


def test_field_names_are_overridable(tmp_path):
    row = {"question": "Q", "better": "yes", "worse": "no", "prompt": 5}
    path = _write(tmp_path / "p.jsonl", [json.dumps(row)])
    got = preferences.read_pairs(
        path, prompt_field="question", chosen_field="better", rejected_field="worse"
    )
    assert got == [Pair("Q", "yes", "no")]
    with pytest.raises(ValueError, match="the field names must differ"):
        preferences.read_pairs(path, chosen_field="prompt")
    with pytest.raises(ValueError, match="rejected_field='' is empty"):
        preferences.read_pairs(path, rejected_field="")


def test_every_bad_row_is_named_by_file_and_line(tmp_path):
    path = _write(
        tmp_path / "bad.jsonl",
        [
            _row("Q", "a", "b"),
            '{"prompt": "Q", "chosen": "a",',  # Not JSON.
            json.dumps({"prompt": "Q", "chosen": "a"}),
            json.dumps({"prompt": "Q", "chosen": ["a"], "rejected": None}),
            json.dumps(["Q", "a", "b"]),
            json.dumps({"chosen": "a", "rejected": "b"}),
        ],
    )
    with pytest.raises(ValueError) as e:
        preferences.read_pairs(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: 5 malformed rows: ")
    assert f"{path}, line 2: bad JSON" in msg
    assert f"{path}, line 3: has no 'rejected'" in msg
    assert (
        f"{path}, line 4: 'chosen' must be a string, got list; "
        "'rejected' must be a string, got null"
    ) in msg
    assert f"{path}, line 5: a row must be a JSON object, got list" in msg
    assert f"{path}, line 6: has no 'prompt'" in msg
    assert "line 1" not in msg


def test_many_bad_rows_name_the_first_ten_and_count_the_rest(tmp_path):
    path = _write(tmp_path / "bad.jsonl", ["not json"] * 13)
    with pytest.raises(ValueError) as e:
        preferences.read_pairs(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: 13 malformed rows")
    assert f"{path}, line 10: bad JSON" in msg and "line 11:" not in msg
    assert msg.endswith("; and 3 more")


def test_empty_and_missing_files(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=r"empty\.jsonl: no rows \(an empty file\)"):
        preferences.read_pairs(empty)
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        preferences.read_pairs(str(tmp_path / "nothere.jsonl"))
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,chosen,rejected\n")
    with pytest.raises(ValueError, match=r"pairs\.csv: unsupported file type"):
        preferences.read_pairs(str(csv))


def test_ties_are_dropped_and_said_once(tmp_path, caplog):
    lines = [
        _row("Q", "same", "same") if i in (1, 4, 5, 7, 8, 9, 11) else _row("Q", f"a{i}", "b")
        for i in range(1, 13)
    ]
    path = _write(tmp_path / "ties.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="absl"):
        pairs = preferences.read_pairs(path)
    assert [p.source for p in pairs] == [f"ties.jsonl:{i}" for i in (2, 3, 6, 10, 12)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{path}: dropped 7 of 12 pairs whose chosen equals rejected "
        "(line 1, line 4, line 5, line 7, line 8, ...)"
    ]


def test_a_file_of_ties_only_is_an_error(tmp_path):
    path = _write(tmp_path / "ties.jsonl", [_row("Q", "x", "x"), _row("R", "", "")])
    with pytest.raises(ValueError, match=r"all 2 pairs have chosen == rejected"):
        preferences.read_pairs(path)


# ------------------------------------------------------------------------------------------
# pairs_from_samples, by hand.
# ------------------------------------------------------------------------------------------

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = [
    ["a", "b", "c", "d"],
    ["e", "f", "g", "h"],
    ["i", "j"],
    ["k", "l", "m"],
]
REWARDS = [
    [0.0, 1.0, 1.0, 0.0],  # Two correct, two incorrect.
    [1.0, 1.0, 1.0, 1.0],  # All equal: no pair.
    [0.0, 1.0],
    [0.5, 0.0, 1.0],  # Graded.
]


def test_best_vs_worst_by_hand():
    got = preferences.pairs_from_samples(PROMPTS, COMPLETIONS, REWARDS)
    # p0: the first best (b, index 1) over the first worst (a, index 0); p1: none.
    assert got == [Pair("p0", "b", "a"), Pair("p2", "j", "i"), Pair("p3", "m", "l")]
    assert [p.source for p in got] == [
        "prompt 0: sample 1 over 0",
        "prompt 2: sample 1 over 0",
        "prompt 3: sample 2 over 1",
    ]


def test_all_by_hand():
    got = preferences.pairs_from_samples(PROMPTS, COMPLETIONS, np.asarray(REWARDS, object), "all")
    assert [(p.prompt, p.chosen, p.rejected) for p in got] == [
        # p0: 2 correct x 2 incorrect, ordered by (chosen index, rejected index).
        ("p0", "b", "a"),
        ("p0", "b", "d"),
        ("p0", "c", "a"),
        ("p0", "c", "d"),
        ("p2", "j", "i"),
        # p3, graded: every strictly ordered pair.
        ("p3", "k", "l"),
        ("p3", "m", "k"),
        ("p3", "m", "l"),
    ]


def test_identical_texts_make_no_pair():
    got = preferences.pairs_from_samples(["p"], [["x", "x", "y"]], [[1, 0, 0]], "all")
    assert got == [Pair("p", "x", "y")]
    assert preferences.pairs_from_samples(["p"], [["x", "x"]], [[1, 0]]) == []


def test_pairs_from_samples_rejects_bad_input():
    with pytest.raises(ValueError, match="mode='pairs' is not one of"):
        preferences.pairs_from_samples(["p"], [["a"]], [[1]], "pairs")
    with pytest.raises(ValueError, match="2 prompts, 1 completion lists and 1 reward lists"):
        preferences.pairs_from_samples(["p", "q"], [["a"]], [[1]])
    with pytest.raises(ValueError) as e:
        preferences.pairs_from_samples(
            ["p", "q"], [["a", "b"], ["c", "d"]], [[1.0], [0.0, float("nan")]]
        )
    assert str(e.value) == (
        "pairs_from_samples: prompt 0: 2 completions but 1 rewards; "
        "prompt 1, sample 1: reward nan is not a finite number"
    )
    with pytest.raises(ValueError, match="prompt 0, sample 0: reward '1' is not a finite"):
        preferences.pairs_from_samples(["p"], [["a", "b"]], [["1", 0]])
