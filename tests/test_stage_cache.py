"""The stage cache (`rlscale.stage_cache`): a stage is complete only once its marker is
written, last; a complete stage made with other settings is refused, the differences listed;
a copy from another workdir is checked the same way."""

import os

import pytest

from rlscale import stage_cache

STAGE = stage_cache.PREFERENCE_PAIRS
SETTINGS = {"seed": 0, "sampling": {"temperature": 1.0, "buckets": (16, 32)}}


def _make(workdir, settings=SETTINGS, record=None):
    path = stage_cache.begin(workdir, STAGE)
    with open(os.path.join(path, "pairs.jsonl"), "w") as f:
        f.write("{}\n")
    stage_cache.complete(workdir, STAGE, settings, record or {"pairs": 1})
    return path


def test_a_stage_is_complete_only_once_marked(tmp_path):
    workdir = str(tmp_path)
    assert stage_cache.lookup(workdir, STAGE, SETTINGS) is None  # Absent.
    path = stage_cache.begin(workdir, STAGE)
    with open(os.path.join(path, "pairs.jsonl"), "w") as f:
        f.write("{}\n")  # Written, then cut off before the marker: incomplete.
    assert stage_cache.lookup(workdir, STAGE, SETTINGS) is None
    assert stage_cache.record(workdir, STAGE) is None
    stage_cache.complete(workdir, STAGE, SETTINGS, {"pairs": 1})
    # A tuple in the settings reads back as the list JSON makes of it: the same settings.
    assert stage_cache.lookup(workdir, STAGE, SETTINGS) == {"pairs": 1}
    stage_cache.begin(workdir, STAGE)  # Being made again: incomplete until marked.
    assert stage_cache.lookup(workdir, STAGE, SETTINGS) is None
    assert os.path.isfile(os.path.join(path, "pairs.jsonl"))


def test_other_settings_are_refused_listing_each(tmp_path):
    workdir = str(tmp_path)
    _make(workdir)
    other = {"seed": 1, "sampling": {"temperature": 0.5, "buckets": (16, 32)}}
    with pytest.raises(ValueError) as e:
        stage_cache.lookup(workdir, STAGE, other)
    message = str(e.value)
    assert "holds a preference pairs made with different settings" in message
    assert "seed: 0 -> 1" in message and "sampling.temperature: 1.0 -> 0.5" in message
    assert "buckets" not in message


def test_copy_checks_the_settings(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with pytest.raises(ValueError, match=r"key='.*src': .* holds no complete preference pairs"):
        stage_cache.copy(src, dst, STAGE, SETTINGS, "key")
    _make(src, record={"pairs": 7})
    with open(os.path.join(src, "tokenizer.model"), "w") as f:
        f.write("t")
    with pytest.raises(ValueError, match="seed: 0 -> 3"):
        stage_cache.copy(src, dst, STAGE, {**SETTINGS, "seed": 3}, "key", ("tokenizer.model",))
    assert not os.path.exists(dst)  # Refused: nothing copied.
    stage_cache.copy(src, dst, STAGE, SETTINGS, "key", ("tokenizer.model",))
    assert stage_cache.lookup(dst, STAGE, SETTINGS) == {"pairs": 7}
    assert os.path.isfile(os.path.join(stage_cache.path(dst, STAGE), "pairs.jsonl"))
    assert os.path.isfile(os.path.join(dst, "tokenizer.model"))


def test_unknown_stage_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown stage 'sfts'"):
        stage_cache.path(str(tmp_path), "sfts")
