"""Batch building (target alignment, padding), micro-batch planning, sharding, metric reduction."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.messages.experience import Experience
from tandem.trainer.batch import build_batch, plan_micro_batches, preference_pairs, shard_rows
from tandem.trainer.metrics import MetricAccumulator


def exp(tokens, prompt_len, action_mask, logprobs, group="g", reward=0.0, version=0):
    return Experience(id=f"{group}-{len(tokens)}-{reward}", task_id=group, group_id=group,
                      tokens=np.array(tokens, dtype=np.int32), prompt_len=prompt_len,
                      action_mask=np.array(action_mask, dtype=np.uint8),
                      logprobs=np.array(logprobs, dtype=np.float32), reward=reward,
                      policy_version=version)


def test_token_tensors_are_aligned_to_targets_and_padded():
    batch = build_batch([
        exp([5, 6, 7, 8], 2, [1, 0], [-0.5, -0.25], group="a", reward=1.0, version=3),
        exp([9, 10, 11], 1, [1, 1], [-1.0, -2.0], group="b"),
        exp([12, 13], 1, [1], [-3.0], group="a"),
    ], pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0], [12, 13, 0, 0]]
    assert batch.attention.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    # column j is about token j+1: row 0's response tokens 7, 8 are targets at columns 1, 2
    assert batch.mask.tolist() == [[0, 1, 0], [1, 1, 0], [1, 0, 0]]
    assert batch.behaviour.tolist() == [[0, -0.5, -0.25], [-1.0, -2.0, 0], [-3.0, 0, 0]]
    assert batch.groups.tolist() == [0, 1, 0] and batch.versions.tolist() == [3, 0, 0]
    sub = batch.select([2])
    assert sub.tokens.tolist() == [[12, 13]] and sub.mask.tolist() == [[1]]


def test_preference_pairs_take_best_and_worst_and_drop_ties():
    batch = build_batch([
        exp([1, 2, 3], 1, [1, 1], [0, 0], group="a", reward=0.0),
        exp([1, 2, 4, 5], 1, [1, 1, 1], [0, 0, 0], group="a", reward=2.0),
        exp([1, 2, 6], 1, [1, 1], [0, 0], group="a", reward=1.0),
        exp([7, 8], 1, [1], [0], group="b", reward=1.0),
        exp([7, 9], 1, [1], [0], group="b", reward=1.0),
    ])
    pairs, dropped = preference_pairs(batch)
    assert dropped == 1
    assert pairs.rewards.tolist() == [2.0, 0.0]
    assert pairs.tokens.tolist() == [[1, 2, 4, 5], [1, 2, 3, 0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 1024),
       st.sampled_from([1, 2]))
def test_micro_batches_cover_every_row_once_within_the_budget(lengths, budget, unit):
    if unit == 2 and len(lengths) % 2:
        lengths = lengths + [1]
    plan = plan_micro_batches(lengths, budget, unit)
    rows = sorted(r for mb in plan for r in mb)
    assert rows == list(range(len(lengths)))
    for mb in plan:
        cost = len(mb) * max(lengths[r] for r in mb)
        assert cost <= budget or len(mb) == unit  # only a lone unit may exceed it
        if unit == 2:  # pairs stay together, in order
            assert all(mb[i] % 2 == 0 and mb[i + 1] == mb[i] + 1 for i in range(0, len(mb), 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=40), st.integers(1, 8))
def test_shards_partition_rows_and_balance_tokens(lengths, world):
    shards = shard_rows(lengths, world)
    assert sorted(r for s in shards for r in s) == list(range(len(lengths)))
    loads = [sum(lengths[r] for r in s) for s in shards]
    if lengths:  # greedy longest-first: no rank exceeds another by more than the longest row
        assert max(loads) - min(loads) <= max(lengths)


def test_metric_reduction_by_name():
    acc = MetricAccumulator()
    acc.add({"loss/policy": torch.tensor(0.5), "policy/clip_frac": 0.2, "policy/ratio_max": 1.5,
             "policy/ratio_min": 0.9}, weight=1.0)
    acc.add({"loss/policy": 0.25, "policy/clip_frac": 0.8, "policy/ratio_max": 1.2,
             "policy/ratio_min": 0.7}, weight=3.0)
    out = acc.result()
    assert out["loss/policy"] == pytest.approx(0.75)  # shares of one loss: summed
    assert out["policy/clip_frac"] == pytest.approx((0.2 + 3 * 0.8) / 4)  # token-weighted mean
    assert out["policy/ratio_max"] == 1.5 and out["policy/ratio_min"] == 0.7
