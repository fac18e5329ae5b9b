"""The bucketed gather of sharded parameters (weight sync, HF export) equals `full_tensor()` exactly.

Three gloo ranks shard a tiny Qwen2 with FSDP2: dim 0 sizes that do not divide by 3 give uneven
shards (and an empty one for a 2-row tensor); mixed dtypes and plain tensors are interleaved, and
tiny buckets force every bucket boundary case. Every name comes back once, in order, bit-equal.
Four ranks check hybrid sharding: 2 replicas of a 2-way shard, and 4 replicas of whole tensors.
Two ranks run the gathers (and Ulysses' sequence gather) on a torch without `all_gather_single`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ballast.engine.gather import iter_gathered
from testkit.engine import full as full_tensor_of
from testkit.engine import spawn_ranks


def _check(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # same full values on every rank
    full = {
        "a": torch.randn(7, 5),                    # 3 + 3 + 1 rows
        "b": torch.randn(2, 3),                    # 1 + 1 + 0 rows: an empty shard
        "plain": torch.randn(4),                   # not a DTensor
        "c": torch.randn(9).to(torch.bfloat16),    # another dtype: its own bucket
        "d": torch.randn(11, 2, 3),
        "e": torch.randn(1),
    }
    named = [(k, v if k == "plain" else distribute_tensor(v, mesh, [Shard(0)])) for k, v in full.items()]
    for bucket_bytes in (1, 64, 1 << 20):
        got = list(iter_gathered(named, bucket_bytes=bucket_bytes))
        assert [n for n, _ in got] == list(full), (bucket_bytes, [n for n, _ in got])
        for name, tensor in got:
            assert not isinstance(tensor, DTensor)
            assert tensor.dtype == full[name].dtype and torch.equal(tensor, full[name]), (bucket_bytes, name)

    # A real FSDP2 model: the gathered state dict equals full_tensor() of every entry.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # sizes not divisible by 3 (vocab 31, hidden 20, intermediate 34): uneven shards everywhere
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=31, hidden_size=20, intermediate_size=34, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=10))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    expected = {k: full_tensor_of(v) for k, v in model.state_dict().items()}
    got = dict(iter_gathered(model.state_dict().items(), bucket_bytes=4096))
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    dist.barrier()


def test_bucketed_gather_equals_full_tensor():
    spawn_ranks(_check, 3, timeout_s=240)


def _check_hybrid(rank: int, world: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for shape in ((2, 2), (4, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        full = {"a": torch.randn(7, 5), "plain": torch.randn(4), "b": torch.randn(1, 3), "c": torch.randn(5).double()}
        named = [(k, v if k == "plain" else distribute_tensor(v, mesh, [Replicate(), Shard(0)])) for k, v in full.items()]
        for bucket_bytes in (1, 1 << 20):
            got = list(iter_gathered(named, bucket_bytes=bucket_bytes))
            assert [n for n, _ in got] == list(full)
            for name, tensor in got:
                assert not isinstance(tensor, DTensor) and torch.equal(tensor, full[name]), (shape, name)
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=31, hidden_size=20, intermediate_size=34, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=10))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        assert all(tuple(v.placements) == (Replicate(), Shard(0)) for v in state.values() if isinstance(v, DTensor))
        expected = {k: full_tensor_of(v) for k, v in state.items()}
        got = dict(iter_gathered(state.items(), bucket_bytes=4096))
        assert list(got) == list(expected)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (shape, name)
    dist.barrier()


def test_bucketed_gather_hybrid_sharding():
    spawn_ranks(_check_hybrid, 4, timeout_s=240)


def _check_without_all_gather_single(rank: int, world: int) -> None:
    # torch 2.11 / 2.12 (allowed by pyproject) have only all_gather_into_tensor: remove the newer name
    # in this rank's process, then run both users of the all-gather.
    del dist.all_gather_single
    from ballast.engine.ulysses import gather_sequence

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = {"a": torch.randn(5, 3), "b": torch.randn(1, 2), "c": torch.randn(4).double()}
    named = [(k, distribute_tensor(v, mesh, [Shard(0)])) for k, v in full.items()]
    got = dict(iter_gathered(named, bucket_bytes=1 << 20))
    assert list(got) == list(full) and all(torch.equal(got[k], full[k]) for k in full)
    mine = torch.full((2, 3), float(rank))
    gathered = gather_sequence(mine, dist.group.WORLD)
    assert torch.equal(gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(world)]))
    dist.barrier()


def test_gathers_work_on_torch_without_all_gather_single():
    spawn_ranks(_check_without_all_gather_single, 2, timeout_s=240)
