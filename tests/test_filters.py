"""Rollout shaping on scripted rewards."""

import numpy as np
import pytest

from rlscale.data import filters


def test_zero_variance_filter():
    r = np.array([[1, 1, 1], [0, 0, 0], [1, 0, 1], [0.5, 0.5, 0.25]])
    assert filters.zero_variance_keep(r).tolist() == [False, False, True, True]


def test_overlong_penalty_hand_values():
    got = filters.overlong_penalty([10, 12, 14, 16, 20], max_len=16, cache_len=4)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len=20"):
        filters.overlong_penalty([1], max_len=16, cache_len=20)


def test_no_positive_resampling_retires_for_good():
    h = filters.PassRateHistory(threshold=0.9)
    assert h.update([7, 8], np.array([[1, 1, 1, 1], [1, 0, 0, 0]])) == [7]
    assert h.update([8], np.array([[1, 1, 1, 1]])) == [8]
    assert h.retired == {7, 8}
    h.update([7], np.array([[0, 0, 0, 0]]))  # Retired prompts stay retired.
    assert 7 in h.retired
    assert filters.PassRateHistory.from_state(h.state()) == h
    stream = filters.PromptStream(num_prompts=10, seed=3)
    seen = stream.next(30, retired=h.retired)
    assert 7 not in seen and 8 not in seen and len(seen) == 30
    assert stream.epoch == 3  # 8 live prompts per epoch: 30 ids reach the 4th epoch.


def test_prompt_stream_resumes_exactly():
    a = filters.PromptStream(num_prompts=13, seed=1)
    first = a.next(9)
    b = filters.PromptStream.from_state(a.state())
    assert a.next(20) == b.next(20)
    assert sorted(first + filters.PromptStream(13, seed=1).next(13)[9:]) == list(range(13))
    with pytest.raises(RuntimeError, match="every training prompt has been retired"):
        filters.PromptStream(2).next(1, retired={0, 1})
