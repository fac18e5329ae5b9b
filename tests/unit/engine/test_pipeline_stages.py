"""The pipeline engine's pure parts, in one process: slots (packing, the hard cap, the shape guard),
the stage split (a chain of stage modules computes what the whole model computes, gradients
included, each stage on its own pruned copy as on its own rank), and the pipeline's config rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ballast.engine.config import EngineConfig, LoraSpec, PipelineSpec, SpecError
from ballast.engine.forward import ForwardOptions, forward_micro_batch
from ballast.engine.model import load_model
from ballast.engine.pipeline.slots import HeadOptions, check_slots, pack_slot, slot_outputs
from ballast.engine.pipeline.stages import StagePlacement, split_model
from testkit.engine import make_rl_batch
from testkit.models import build_tiny_causal_lm

PROMPTS = [3, 9, 1, 14, 6]
RESPONSES = [5, 0, 11, 2, 7]


@pytest.fixture(scope="module")
def four_layer_lm(tmp_path_factory):
    return build_tiny_causal_lm(str(tmp_path_factory.mktemp("pp_lm")), seed=3, num_layers=4, tie_word_embeddings=True)


def _rows(n):
    return torch.arange(n)


def test_a_slot_packs_real_tokens_first_and_keeps_the_predicting_positions():
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=64, seed=1)
    head = HeadOptions(is_critic=False, calculate_entropy=True)
    mb = pack_slot(data, _rows(5), 128, head)
    real = int(data["attention_mask"].sum())
    assert mb.input_ids.shape == (1, 128) and mb.slot.num_tokens == real
    assert torch.all(mb.input_ids[0, real:] == 0) and torch.all(mb.slot.position_ids[0, real:] == 0)
    assert mb.slot.attention.cu_seqlens.tolist()[-1] == real
    assert len(mb.slot.keep) == int(data["response_mask"].sum()) == len(mb.slot.labels)
    assert torch.equal(mb.input_ids[0, mb.slot.keep + 1], mb.slot.labels)  # each kept position predicts the next token
    with pytest.raises(ValueError, match=f"holds {real} tokens, more than its pipeline slot of 40"):
        pack_slot(data, _rows(5), 40, head)
    empty = pack_slot(data[:0], _rows(0), 128, head)
    assert empty.batch_size == 0 and empty.slot.num_tokens == 0 and empty.input_ids.shape == (1, 128)


def test_the_shape_guard_names_a_micro_batch_of_another_shape():
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=64, seed=1)
    head = HeadOptions(is_critic=False)
    good = [pack_slot(data[:2], _rows(2), 64, head), pack_slot(data[2:], _rows(3), 64, head)]
    check_slots(good, 64)
    shrunk = dataclasses.replace(good[1], input_ids=good[1].input_ids[:, :48],
                                 slot=dataclasses.replace(good[1].slot, position_ids=good[1].slot.position_ids[:, :48]))
    with pytest.raises(ValueError, match=r"pipeline micro-batch 1 has .*\(1, 48\).*slots of shape \(1, 64\)"):
        check_slots([good[0], shrunk], 64)
    with pytest.raises(ValueError, match="pipeline micro-batch 0 has"):
        check_slots(good, 128)  # stages built for a larger slot: the micro-batches would shrink into them


def _chain(model_dir, bounds, pp, data, opts, role="actor"):
    """Run every stage of the split on its own pruned copy, as the pipeline would; returns the last
    stage's outputs as (B, R) and the copies (for their gradients)."""
    placement = StagePlacement(bounds, pp)
    copies, stages = [], {}
    for rank in range(pp):
        model = load_model(model_dir, role)
        for index, stage in zip(placement.local_stages(rank), split_model(model, placement, rank, role == "critic")):
            stages[index] = stage
        copies.append(model)
    head = HeadOptions(is_critic=role == "critic", temperature=opts.temperature,
                       calculate_entropy=opts.calculate_entropy, chunk_tokens=opts.chunk_tokens)
    mb = pack_slot(data, _rows(data.batch_size[0]), 96, head)
    x = mb.input_ids
    for index in range(len(bounds)):
        x = stages[index](x, mb.slot)
        if index < len(bounds) - 1:
            assert x.shape == (1, 96, copies[0].config.hidden_size)  # every hop carries a whole slot
    return slot_outputs(x, mb), copies


@pytest.mark.parametrize("bounds, pp", [(((0, 2), (2, 4)), 2), (((0, 1), (1, 2), (2, 3), (3, 4)), 2),
                                        (((0, 1), (1, 3), (3, 4)), 3)])
def test_a_chain_of_stages_computes_the_whole_model(four_layer_lm, bounds, pp):
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=5)
    opts = ForwardOptions(is_critic=False, use_remove_padding=True, temperature=0.7, calculate_entropy=True,
                          chunk_tokens=8)
    whole = load_model(four_layer_lm, "actor")
    expected = forward_micro_batch(whole, data, opts)
    (expected["log_probs"] * data["advantages"] + 0.1 * expected["entropy"]).sum().backward()
    out, copies = _chain(four_layer_lm, bounds, pp, data, opts)
    torch.testing.assert_close(out["log_probs"], expected["log_probs"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["entropy"], expected["entropy"], atol=1e-6, rtol=1e-6)
    (out["log_probs"] * data["advantages"] + 0.1 * out["entropy"]).sum().backward()
    reference = dict(whole.named_parameters())
    seen = {}
    for copy in copies:
        for name, p in copy.named_parameters():
            key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            seen[key] = seen.get(key, 0) + p.grad  # the tied matrix: embedding and head copies add up
    assert set(seen) == set(reference)
    for name, grad in seen.items():
        torch.testing.assert_close(grad, reference[name].grad, atol=1e-6, rtol=1e-5)


def test_each_rank_keeps_only_its_stages_under_the_models_own_names(four_layer_lm):
    placement = StagePlacement(((0, 1), (1, 2), (2, 3), (3, 4)), 2)  # v = 2: stages 0, 2 on rank 0
    first, last = load_model(four_layer_lm, "actor"), load_model(four_layer_lm, "actor")
    split_model(first, placement, 0, False)
    split_model(last, placement, 1, False)
    assert {n.split(".")[2] for n in first.state_dict() if n.startswith("model.layers.")} == {"0", "2"}
    assert "model.embed_tokens.weight" in first.state_dict() and "lm_head.weight" not in first.state_dict()
    assert "lm_head.weight" in last.state_dict() and "model.norm.weight" in last.state_dict()
    assert "model.embed_tokens.weight" not in last.state_dict()
    assert placement.rank_of("model.layers.3.mlp.up_proj.weight") == 1 and placement.stage_of("lm_head.weight") == 3
    with pytest.raises(ValueError, match="cannot place 'model.vision_tower.weight'"):
        placement.stage_of("model.vision_tower.weight")


def test_the_critic_stage_ends_in_the_value_head(four_layer_lm):
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=6)
    whole = load_model(four_layer_lm, "critic", seed=4)
    expected = forward_micro_batch(whole, data, ForwardOptions(is_critic=True, use_remove_padding=True))
    placement = StagePlacement(((0, 2), (2, 4)), 2)
    models = [load_model(four_layer_lm, "critic", seed=4) for _ in range(2)]
    stages = [split_model(m, placement, r, True)[0] for r, m in enumerate(models)]
    mb = pack_slot(data, _rows(5), 96, HeadOptions(is_critic=True))
    out = slot_outputs(stages[1](stages[0](mb.input_ids, mb.slot), mb.slot), mb)
    torch.testing.assert_close(out["values"], expected["values"], atol=1e-6, rtol=1e-6)


def test_pipeline_config_names_what_does_not_compose(tmp_path):
    path = str(tmp_path)
    assert not PipelineSpec().enabled and PipelineSpec(2).shape.num_stages == 2
    with pytest.raises(SpecError, match="virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"):
        PipelineSpec(1, 2)
    with pytest.raises(SpecError, match="virtual_stages=2 needs schedule") as err:
        PipelineSpec(2, 2, "1f1b")
    assert err.value.field == "virtual_stages"
    with pytest.raises(SpecError, match="microbatch_group_size_per_vp_stage=3") as err:
        PipelineSpec(2, 2, "interleaved_1f1b", microbatch_group_size=3)
    assert err.value.field == "microbatch_group_size"
    with pytest.raises(SpecError, match="pipeline schedule must be one of"):
        PipelineSpec(2, 1, "gpipe")
    pipe = PipelineSpec(2)
    cases = [
        (dict(use_remove_padding=False), "use_remove_padding", "needs use_remove_padding=True"),
        (dict(ulysses_sequence_parallel_size=2), "ulysses_sequence_parallel_size", "does not compose with Ulysses"),
        (dict(lora=LoraSpec(rank=4)), "lora", "does not train LoRA adapters"),
        (dict(cpu_offload=True), "cpu_offload", "does not offload"),
        (dict(fsdp_size=2), "fsdp_size", "keeps whole replicas"),
        (dict(precision="bf16"), "precision", "computes in fp32 only"),
    ]
    for kwargs, field, message in cases:
        with pytest.raises(SpecError, match=message) as err:
            EngineConfig(model_path=path, pipeline=pipe, **kwargs)
        assert err.value.field == field
    EngineConfig(model_path=path, pipeline=pipe, fsdp_size=1, precision="fp32")
