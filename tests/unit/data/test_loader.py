"""StatefulDataLoader: seeded per-epoch order covering every sample once, exact resume from a saved
state (also with worker processes that prefetch ahead), and clear errors for invalid knobs."""

import pytest
import torch

from ballast.data import StatefulDataLoader


class _Indices(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _stream(loader, num_batches):
    """The next `num_batches` batches as lists, crossing epoch boundaries like a trainer does."""
    out = []
    while len(out) < num_batches:
        for batch in loader:
            out.append(batch.tolist())
            if len(out) == num_batches:
                break
    return out


def test_each_epoch_is_a_seeded_permutation():
    loader = StatefulDataLoader(_Indices(10), batch_size=5, seed=3, drop_last=False)
    epoch0 = sum(_stream(loader, 2), [])
    epoch1 = sum(_stream(loader, 2), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled per epoch
    again = StatefulDataLoader(_Indices(10), batch_size=5, seed=3, drop_last=False)
    assert sum(_stream(again, 4), []) == epoch0 + epoch1
    other_seed = StatefulDataLoader(_Indices(10), batch_size=5, seed=4, drop_last=False)
    assert sum(_stream(other_seed, 2), []) != epoch0
    ordered = StatefulDataLoader(_Indices(10), batch_size=5, shuffle=False)
    assert sum(_stream(ordered, 2), []) == list(range(10))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])
def test_resume_from_state_continues_with_the_same_batches(drop_last, stop_after):
    """batch 3 per epoch of 11 samples: resuming mid-epoch, at an epoch's end and in the next epoch."""
    reference = _stream(StatefulDataLoader(_Indices(11), batch_size=3, seed=7, drop_last=drop_last), 10)
    first = StatefulDataLoader(_Indices(11), batch_size=3, seed=7, drop_last=drop_last)
    seen = _stream(first, stop_after)
    state = first.state_dict()
    resumed = StatefulDataLoader(_Indices(11), batch_size=3, seed=999, drop_last=drop_last)  # seed comes from state
    resumed.load_state_dict(state)
    assert seen + _stream(resumed, 10 - stop_after) == reference


def test_breaking_out_and_iterating_again_continues_in_process():
    reference = _stream(StatefulDataLoader(_Indices(12), batch_size=4, seed=1), 6)
    loader = StatefulDataLoader(_Indices(12), batch_size=4, seed=1)
    got = _stream(loader, 1) + _stream(loader, 1) + _stream(loader, 4)
    assert got == reference
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 12


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_prefetch_does_not_shift_the_resume_point(persistent):
    """Workers fetch batches ahead of the caller; the state must count only what was yielded."""
    reference = _stream(StatefulDataLoader(_Indices(16), batch_size=2, seed=5), 12)
    knobs = dict(num_workers=2, prefetch_factor=4, persistent_workers=persistent)
    first = StatefulDataLoader(_Indices(16), batch_size=2, seed=5, **knobs)
    seen = _stream(first, 3)
    assert first.state_dict()["position"] == 6
    again_in_process = _stream(first, 2)
    resumed = StatefulDataLoader(_Indices(16), batch_size=2, seed=5, **knobs)
    resumed.load_state_dict(first.state_dict())
    assert seen + again_in_process + _stream(resumed, 7) == reference


def test_len_counts_batches_per_epoch():
    assert len(StatefulDataLoader(_Indices(10), batch_size=3, drop_last=True)) == 3
    assert len(StatefulDataLoader(_Indices(10), batch_size=3, drop_last=False)) == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(num_workers=-1), "dataloader_num_workers must be an int >= 0"),
        (dict(prefetch_factor=2), r"prefetch_factor=2 needs data.dataloader_num_workers > 0"),
        (dict(num_workers=1, prefetch_factor=0), "prefetch_factor must be a positive int or None"),
        (dict(persistent_workers=True), "persistent_workers=True needs data.dataloader_num_workers > 0"),
        (dict(batch_size=20), "dataset has 10 samples < batch_size=20 with drop_last=True"),
    ],
)
def test_invalid_knobs_are_explained(kwargs, match):
    args = dict(batch_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        StatefulDataLoader(_Indices(10), **args)


def test_state_for_another_dataset_is_rejected():
    state = StatefulDataLoader(_Indices(10), batch_size=2).state_dict()
    with pytest.raises(ValueError, match="saved for 10 samples but the dataset has 12"):
        StatefulDataLoader(_Indices(12), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys \\['position'\\]"):
        StatefulDataLoader(_Indices(10), batch_size=2).load_state_dict({"epoch": 0, "seed": 0})
    with pytest.raises(ValueError, match="out of range: epoch=0, position=11"):
        StatefulDataLoader(_Indices(10), batch_size=2).load_state_dict(state | {"position": 11})
