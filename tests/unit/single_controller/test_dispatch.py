"""Pure split/collect logic of the dispatch modes and the @register contract (no Ray)."""

import pytest
import torch

from ballast.protocol import Batch
from ballast.single_controller.decorator import Dispatch, register, registration_of
from ballast.single_controller.dispatch import concat_results, mesh_layout, split_args
from ballast.single_controller.worker import MeshInfo


def _batch(n):
    return Batch({"idx": torch.arange(n)})


def test_split_args_cuts_batches_and_broadcasts_the_rest():
    per_args, per_kwargs, pad = split_args([_batch(8), "x"], {"b": _batch(8), "k": 3}, 4, False, "m")
    assert pad == 0 and len(per_args) == 4
    assert [a[0]["idx"].tolist() for a in per_args] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(a[1] == "x" and k["k"] == 3 for a, k in zip(per_args, per_kwargs))
    assert [k["b"]["idx"].tolist() for k in per_kwargs] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_split_errors_name_sizes_and_padding_round_trips():
    with pytest.raises(ValueError, match=r"m: a Batch of 7 samples cannot be split evenly over 4"):
        split_args([_batch(7)], {}, 4, False, "m")
    with pytest.raises(ValueError, match="different lengths"):
        split_args([_batch(4), _batch(8)], {}, 4, False, "m")
    per_args, _, pad = split_args([_batch(7)], {}, 4, True, "m")
    assert pad == 1 and all(len(a[0]) == 2 for a in per_args)
    out = concat_results([a[0] for a in per_args], pad, "m")
    assert out["idx"].tolist() == list(range(7))


def test_concat_results_of_plain_values_is_a_list():
    assert concat_results([1, 2], 0, "m") == [1, 2]
    with pytest.raises(TypeError):
        concat_results([_batch(1), 3], 0, "m")


def test_mesh_layout_validates_declarations():
    infos = [MeshInfo(r // 2, 2, r % 2 == 0) for r in range(4)]
    assert mesh_layout(infos, "actor") == (2, [0, 0, 1, 1], [0, 2])
    with pytest.raises(ValueError, match="disagree on dp_size"):
        mesh_layout([MeshInfo(0, 1, True), MeshInfo(0, 2, True)], "a")
    with pytest.raises(ValueError, match="two collect workers"):
        mesh_layout([MeshInfo(0, 1, True), MeshInfo(0, 1, True)], "a")
    with pytest.raises(ValueError, match=r"dp ranks \[1\] have no collect worker"):
        mesh_layout([MeshInfo(0, 2, True), MeshInfo(1, 2, False)], "a")


def test_register_contract():
    @register(Dispatch.MESH, mesh="actor")
    def f(self, batch):
        return batch

    assert registration_of(f).mesh == "actor"
    with pytest.raises(ValueError, match="mesh=<role> is required"):
        register(Dispatch.MESH)
    with pytest.raises(ValueError, match="pad=True"):
        register(Dispatch.ONE_TO_ALL, pad=True)
