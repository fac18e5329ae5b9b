"""Bucketed micro-batches: one bucket per micro-batch, hard cap, every count from the minimum to N."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.balance.bucketing import bucket_ids, min_bucketed_micro_batches, plan_bucketed_micro_batches


def test_bucket_ids_follow_the_boundaries():
    assert bucket_ids([1, 64, 65, 256, 257, 5000], [64, 256, 1024, 4096]).tolist() == [0, 0, 1, 1, 2, 4]
    with pytest.raises(ValueError, match=r"bucket_boundaries=\[64, 32\]"):
        bucket_ids([1], [64, 32])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plans_never_mix_buckets_never_exceed_the_cap_and_take_every_count(data):
    n = data.draw(st.integers(1, 40))
    cap = data.draw(st.integers(50, 400))
    lengths = np.array(data.draw(st.lists(st.integers(1, cap), min_size=n, max_size=n)))
    prompts = np.array(data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n)))
    buckets = bucket_ids(prompts, [16, 64, 128])
    low = min_bucketed_micro_batches(lengths, buckets, cap)
    k = data.draw(st.integers(low, n))
    plan = plan_bucketed_micro_batches(lengths, buckets, cap, num_micro_batches=k)
    assert len(plan) == k and all(len(mb) for mb in plan)
    assert sorted(np.concatenate(plan).tolist()) == list(range(n))
    for mb in plan:
        assert lengths[mb].sum() <= cap
        assert len(set(buckets[mb].tolist())) == 1


def test_short_prompts_are_not_packed_with_long_ones():
    lengths = np.array([10, 10, 10, 10, 300, 300])
    prompts = np.array([20, 20, 20, 20, 900, 900])
    plan = plan_bucketed_micro_batches(lengths, bucket_ids(prompts, [64, 256, 1024]), max_tokens=640)
    groups = sorted(sorted(mb.tolist()) for mb in plan)
    assert groups == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="outside"):
        plan_bucketed_micro_batches(lengths, bucket_ids(prompts, [64]), max_tokens=640, num_micro_batches=1)
