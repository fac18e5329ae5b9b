"""Property-based round trips over random batches (sizes, dtypes, trailing shapes, object payloads).

Every generated batch tracks each sample's original position (`row` tensor and `tag` object array),
so the properties check exactly where every sample went, not just sizes.
"""

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import batches, rows

from ballast.protocol import PAD_COUNT_KEY, Batch

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(batch=batches(min_samples=1), num_chunks=st.integers(1, 8))
def test_chunk_then_concat_is_identity(batch, num_chunks):
    chunks = batch.chunk(num_chunks, pad=True)
    assert len(chunks) == num_chunks and len({len(chunk) for chunk in chunks}) == 1
    assert Batch.concat(chunks).unpad().equals(batch)
    if len(batch) % num_chunks == 0:
        exact = batch.chunk(num_chunks)
        assert Batch.concat(exact).equals(batch) and PAD_COUNT_KEY not in exact[0].meta


@FAST
@given(data=st.data(), batch=batches())
def test_reorder_then_inverse_is_identity(data, batch):
    order = np.array(data.draw(st.permutations(range(len(batch)))), dtype=np.int64)
    permuted = batch.reordered(order)
    assert rows(permuted) == order.tolist()
    inverse = np.argsort(order)
    assert permuted.reordered(inverse).equals(batch)
    in_place = batch.clone()
    in_place.reorder(order)
    in_place.reorder(inverse)
    assert in_place.equals(batch)


@FAST
@given(batch=batches(), repeat_times=st.integers(1, 4))
def test_repeat_interleave_keeps_each_prompts_samples_adjacent(batch, repeat_times):
    interleaved = batch.repeat(repeat_times, interleave=True)
    assert rows(interleaved) == [row for row in range(len(batch)) for _ in range(repeat_times)]
    for group in interleaved.split(repeat_times):
        assert len(set(group["tag"])) == 1
        assert all(group[[i]].equals(group[[0]]) for i in range(len(group)))
    tiled = batch.repeat(repeat_times, interleave=False)
    assert rows(tiled) == list(range(len(batch))) * repeat_times
    for copy in tiled.split(len(batch)) if len(batch) else []:
        assert copy.equals(batch)


@FAST
@given(batch=batches(), divisor=st.integers(1, 9))
def test_pad_then_unpad_is_identity(batch, divisor):
    padded, pad_count = batch.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0 and 0 <= pad_count < divisor and len(padded) == len(batch) + pad_count
    if len(batch):
        assert rows(padded)[len(batch):] == [i % len(batch) for i in range(pad_count)]
    assert padded.unpad().equals(batch) and padded.unpad(pad_count).equals(batch)


@FAST
@given(batch=batches(), split_size=st.integers(1, 6))
def test_split_sizes_and_concat(batch, split_size):
    parts = batch.split(split_size)
    full, remainder = divmod(len(batch), split_size)
    assert [len(part) for part in parts] == [split_size] * full + ([remainder] if remainder else [])
    if parts:
        assert Batch.concat(parts).equals(batch)


@FAST
@given(data=st.data(), batch=batches())
def test_select_pop_union_are_consistent(data, batch):
    chosen = data.draw(st.lists(st.sampled_from(batch.keys()), unique=True))
    rest = [key for key in batch.keys() if key not in chosen]
    selected, complement = batch.select(chosen), batch.select(rest)
    assert sorted(selected.keys()) == sorted(chosen) and len(selected) == len(batch)
    assert selected.union(complement).equals(batch)
    assert selected.union(batch).equals(batch), "union with a superset must add the missing keys"
    remaining = batch.clone()
    popped = remaining.pop(chosen)
    assert popped.equals(selected) and remaining.equals(complement)
    assert remaining.union(popped).equals(batch)


@FAST
@given(data=st.data(), batch=batches())
def test_mask_and_index_array_select_the_same_samples(data, batch):
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch))), dtype=bool)
    by_mask = batch[mask]
    assert rows(by_mask) == np.flatnonzero(mask).tolist()
    assert by_mask.equals(batch[np.flatnonzero(mask)]) and by_mask.equals(batch[list(np.flatnonzero(mask))])


@FAST
@given(batch=batches(), protocol=st.sampled_from([4, 5]))
def test_pickle_round_trip(batch, protocol):
    buffers = []
    payload = pickle.dumps(batch, protocol=protocol, buffer_callback=buffers.append if protocol == 5 else None)
    restored = pickle.loads(payload, buffers=buffers)
    assert restored.equals(batch)
    assert [restored[k].dtype for k in batch.tensor_keys] == [batch[k].dtype for k in batch.tensor_keys]
    assert [restored[k].shape for k in batch.tensor_keys] == [batch[k].shape for k in batch.tensor_keys]
