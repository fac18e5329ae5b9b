"""Weights through Ray's object store in buckets (split resource pools): every tensor arrives once, in
order and bit for bit, buckets respect their size, and the source's later changes do not leak in."""

import pytest
import ray
import torch

from ballast.single_controller.object_store import iter_buckets, put_buckets


def _named(count=7, numel=1000):
    gen = torch.Generator().manual_seed(0)
    return [(f"layer{i}.weight", torch.randn(numel + 10 * i, generator=gen)) for i in range(count)]


def test_buckets_round_trip_every_tensor_in_order(ray_session):
    named = _named()
    bucket_bytes = 3 * 4 * 1000  # about three tensors per bucket
    refs, count, nbytes = put_buckets(iter(named), bucket_bytes)
    assert count == len(named) and nbytes == sum(t.numel() * 4 for _, t in named)
    sizes = [sum(t.numel() * t.element_size() for _, t in ray.get(ref)) for ref in refs]
    # a bucket is closed as soon as it reaches bucket_bytes: all but the last hold >= bucket_bytes,
    # and none holds more than bucket_bytes plus its last tensor
    assert len(refs) == 3 and all(s >= bucket_bytes for s in sizes[:-1])
    assert all(s < bucket_bytes + 4 * 1100 for s in sizes)
    got = list(iter_buckets(refs))
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named))


def test_a_tensor_changed_after_the_put_is_not_seen(ray_session):
    named = _named(count=2)
    refs, _, _ = put_buckets(iter(named), 1 << 20)
    expected = [t.clone() for _, t in named]
    for _, t in named:
        t.add_(1.0)  # the next optimizer step writes into the live parameters
    assert all(torch.equal(a, b) for (_, a), b in zip(iter_buckets(refs), expected))


def test_a_bucket_size_must_be_positive(ray_session):
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        put_buckets(iter(_named(count=1)), 0)


def test_floating_point_tensors_travel_in_the_rollouts_dtype(ray_session):
    named = [("w", torch.randn(8)), ("steps", torch.arange(3))]
    refs, _, nbytes = put_buckets(iter(named), 1 << 20, dtype=torch.bfloat16)
    (w, steps) = [t for _, t in iter_buckets(refs)]
    assert w.dtype == torch.bfloat16 and torch.equal(w, named[0][1].to(torch.bfloat16))
    assert steps.dtype == torch.int64 and torch.equal(steps, named[1][1])  # integers are left alone
    assert nbytes == 8 * 2 + 3 * 8
