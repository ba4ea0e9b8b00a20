"""Staleness per token: a response whose weights changed mid-generation counts each action
token at the version that produced it, its sequence at its oldest."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.common.messages.experience import Experience
from tandem.trainer.batch import build_batch, staleness_metrics


def exp(name, tokens, prompt_len, action_mask, version, token_versions=None):
    response = len(tokens) - prompt_len
    return Experience(id=name, task_id=name, group_id=name,
                      tokens=np.arange(len(tokens), dtype=np.int32), prompt_len=prompt_len,
                      action_mask=np.array(action_mask, dtype=np.uint8),
                      logprobs=np.zeros(response, dtype=np.float32), policy_version=version,
                      token_versions=token_versions)


def test_token_versions_are_aligned_to_targets():
    batch = build_batch([
        exp("a", range(6), 2, [1, 1, 1, 1], 3, np.array([3, 3, 4, 4], dtype=np.int32)),
        exp("b", range(4), 2, [1, 0], 2),
    ])
    # column j is about token j+1: row a's response starts at column 1
    assert batch.token_versions.tolist() == [[0, 3, 3, 4, 4], [0, 2, 2, 0, 0]]
    assert batch.select([1]).token_versions.tolist() == [[0, 2, 2]]


def test_staleness_counts_each_token_at_its_own_version():
    batch = build_batch([
        # interrupted: 2 tokens under v3, then 2 under v5 (its sequence counts as v3)
        exp("a", range(6), 2, [1, 1, 1, 1], 3, np.array([3, 3, 5, 5], dtype=np.int32)),
        # one version throughout; its second response token is not an action (a tool's)
        exp("b", range(4), 2, [1, 0], 4),
    ])
    m = staleness_metrics(batch, version=6)
    assert m["staleness/mean"] == pytest.approx(((6 - 3) + (6 - 4)) / 2)
    assert m["staleness/max"] == 3
    # action tokens: 3, 3, 1, 1 (row a) and 2 (row b); b's masked token does not count
    assert m["staleness/token_mean"] == pytest.approx((3 + 3 + 1 + 1 + 2) / 5)
    assert m["staleness/token_max"] == 3
