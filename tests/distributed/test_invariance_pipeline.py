"""Pipeline parallelism in the invariance matrix: loss, gradients and log-probs of one mini-batch
through `PipelineEngine` equal the single-process plain-PyTorch reference, for pp in {2, 4}, every
schedule (1F1B, interleaved 1F1B, zero bubble), v in {1, 2}, dp in {1, 2}, static and token-budget
cuts and the driver's central plan, remove-padding on, tied embeddings (the tiny model ties them),
the four loss aggregation modes rotated over the cuts. Plus, on two ranks: the critic's values and
gradient, the shape guard, and a step's optimizer update equal to the non-pipeline engine's.

Three process groups in all (spawning costs seconds each): (pp, dp) = (2, 1), (2, 2), (4, 1); every
configuration of a layout runs inside its one launch, against references computed once, here.

Tolerance (fp32), as the engine's matrix: |loss - ref| <= 1e-5 max(1, |ref|), max |grad - ref| <=
1e-5 ||ref grad||_2, log-probs within 1e-5 of the reference's.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial

import numpy as np
import pytest
import torch
import transformers

from ballast.balance import MicroBatchPolicy, PipelineCostModel, PipelineShape, FlopsModel, plan_phase
from ballast.engine import EngineConfig, MicroBatchSpec
from ballast.engine.config import OptimConfig, PipelineSpec
from ballast.engine.losses import LOSS_AGG_MODES, agg_loss
from testkit.engine import make_rl_batch, reference_log_probs, spawn_ranks, whole_batch_loss
from testkit.models import build_tiny_causal_lm

transformers.utils.logging.disable_progress_bar()

TEMPERATURE = 0.9
ENTROPY_COEF = 0.01
REL_TOL = 1e-5
NUM_SAMPLES = 16
NUM_LAYERS = 8  # pp=4 with two virtual stages per rank: 8 stages of one layer
TIED = "model.embed_tokens.weight"

# (pp, dp) -> engines: (schedule, virtual stages)
LAYOUTS = {
    (2, 1): [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2)],
    (2, 2): [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)],
    (4, 1): [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)],
}
CUTS = ("static-2", "dynamic-tight", "central")


def rl_loss(outputs, micro, norm, mode):
    mask = micro["response_mask"]
    loss_mat = -micro["advantages"] * outputs["log_probs"] - ENTROPY_COEF * outputs["entropy"]
    return agg_loss(loss_mat, mask, mode, norm), {"entropy": agg_loss(outputs["entropy"], mask, "token-mean", norm)}


def value_loss(outputs, micro, norm):
    err = (outputs["values"] - micro["advantages"]) ** 2
    return agg_loss(err, micro["response_mask"], "token-mean", norm), {}


def _lengths():
    rng = np.random.default_rng(77)
    totals = rng.integers(3, 60, NUM_SAMPLES)
    prompts = np.maximum(1, (totals * rng.uniform(0.2, 0.6, NUM_SAMPLES)).astype(int))
    responses = np.maximum(0, totals - prompts)
    responses[0] = 0  # one empty response
    return prompts.tolist(), responses.tolist()


def _references(model_dir, data):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    mask = data["response_mask"].float()
    refs = {}
    for mode in LOSS_AGG_MODES:
        model.zero_grad(set_to_none=True)
        lp, ent = reference_log_probs(model, data, TEMPERATURE)
        loss = whole_batch_loss(-data["advantages"] * lp - ENTROPY_COEF * ent, mask, mode, data["responses"].shape[1])
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        refs[mode] = (float(loss.detach()), float((ent.detach() * mask).sum() / mask.sum()), grads)
    with torch.no_grad():
        lp, ent = reference_log_probs(model, data, TEMPERATURE)
    refs["log_probs"], refs["entropy"] = lp, ent
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels, config.classifier_dropout = 1, 0.0
    critic = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                             attn_implementation="sdpa")
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    critic.save_pretrained(os.path.join(model_dir, "..", "critic"))
    values = _reference_values(critic, data)
    loss = (((values - data["advantages"]) ** 2) * mask).sum() / mask.sum()
    loss.backward()
    refs["critic"] = (float(loss.detach()), values.detach(), {n: p.grad.detach().clone() for n, p in critic.named_parameters()})
    return refs


def _reference_values(critic, data):
    R = data["responses"].shape[1]
    P = data["input_ids"].shape[1] - R
    rows = []
    for b in range(NUM_SAMPLES):
        keep = data["attention_mask"][b].bool()
        out = critic(input_ids=data["input_ids"][b][keep][None], use_cache=False).logits[0, :, 0]
        p, r = int(keep[:P].sum()), int(keep[P:].sum())
        rows.append(torch.nn.functional.pad(out[p - 1:p - 1 + r], (0, R - r)))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_invariance")
    model_dir = build_tiny_causal_lm(str(root / "model"), seed=7, num_layers=NUM_LAYERS, tie_word_embeddings=True)
    prompts, responses = _lengths()
    data = make_rl_batch(prompts, responses, vocab_size=128, seed=11)
    torch.save(data.to_dict(), root / "data.pt")
    torch.save(_references(model_dir, data), root / "ref.pt")
    torch.save(_stepped_reference(model_dir, data), root / "stepped.pt")
    return str(root), model_dir


def _stepped_reference(model_dir, data):
    """The weights after one clipped AdamW step of the token-mean loss (grad_clip 1.0, as the engine's)."""
    from transformers import AutoModelForCausalLM

    from ballast.engine.optim import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    lp, ent = reference_log_probs(model, data, TEMPERATURE)
    mask = data["response_mask"].float()
    whole_batch_loss(-data["advantages"] * lp - ENTROPY_COEF * ent, mask, "token-mean", 1).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm=1.0)
    build_optimizer(model.parameters(), OptimConfig(lr=STEP_LR)).step()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["__grad_norm__"] = norm.detach()
    return out


def _specs(lengths, rows):
    return {"static-2": MicroBatchSpec(micro_batch_size_per_gpu=2),
            "dynamic-tight": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=int(lengths.max())),
            "central": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=int(lengths.max()) * 2)}


def _grad_diffs(engine, ref_grads):
    """{reference name: max |diff|} over this rank's parameters (a tied head's copy under the embedding's name)."""
    from testkit.engine import full

    out = {}
    for name, p in engine.model.named_parameters():
        ref_name = TIED if name == "lm_head.weight" and name not in ref_grads else name
        out.setdefault(ref_name, 0.0)
        out[ref_name] = max(out[ref_name], float((full(p.grad) - ref_grads[ref_name]).abs().max()))
    return out


def _pipeline_worker(rank, world, root, model_dir, pp):
    import torch.distributed as dist
    from tensordict import TensorDict

    from ballast.engine.pipeline import PipelineEngine, build_pipeline_state

    data = TensorDict(torch.load(os.path.join(root, "data.pt"), weights_only=True), batch_size=[NUM_SAMPLES])
    refs = torch.load(os.path.join(root, "ref.pt"), weights_only=False)
    parallel = build_pipeline_state(pp, "cpu")
    dp = parallel.dp_size
    rows = NUM_SAMPLES // dp
    local = data[parallel.dp_rank * rows:(parallel.dp_rank + 1) * rows]
    lengths = data["attention_mask"].sum(-1).numpy()
    specs = _specs(lengths, rows)
    results, case = [], 0
    for schedule, v in LAYOUTS[(pp, dp)]:
        engine = PipelineEngine(EngineConfig(model_path=model_dir, pipeline=PipelineSpec(pp, v, schedule)),
                                parallel=parallel)
        central = plan_phase(lengths, dp, dataclasses_replace(specs["central"].policy(1), engine.cost_model),
                             workload=engine.workload)
        for cut in CUTS:
            if cut == "central":
                batch, plan = data[torch.as_tensor(central.rank_rows(parallel.dp_rank))], central.mini_batches[0]
                row_ids = central.rank_rows(parallel.dp_rank)
            else:
                batch, plan = local, engine.plan_micro_batches(local, specs[cut])
                row_ids = np.arange(parallel.dp_rank * rows, (parallel.dp_rank + 1) * rows)
            mode = LOSS_AGG_MODES[case % 4]
            case += 1
            metrics = engine.forward_backward_batch(batch, partial(rl_loss, mode=mode), plan, temperature=TEMPERATURE,
                                                    calculate_entropy=True)
            ref_loss, ref_entropy, ref_grads = refs[mode]
            diffs = _grad_diffs(engine, ref_grads)
            engine.zero_grad()
            out = engine.infer_batch(batch, plan, temperature=TEMPERATURE, calculate_entropy=True)
            ref_lp = refs["log_probs"][torch.as_tensor(row_ids)]
            ref_ent = refs["entropy"][torch.as_tensor(row_ids)]
            results.append(dict(
                schedule=schedule, v=v, cut=cut, mode=mode, loss=metrics["loss"], ref_loss=ref_loss,
                entropy=metrics["entropy"], ref_entropy=ref_entropy, grad_diffs=diffs,
                ref_grad_norm=math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref_grads.values())),
                lp_diff=float((out["log_probs"] - ref_lp).abs().max()), ent_diff=float((out["entropy"] - ref_ent).abs().max()),
                num_micro_batches=plan.num_micro_batches, slot=plan.slot_tokens,
                bubble=metrics["perf/pp_bubble_fraction"], predicted=metrics["perf/pp_bubble_fraction_predicted"]))
    if (pp, dp) == (2, 1):
        results.extend(_two_rank_extras(rank, root, model_dir, parallel, data, refs, specs))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(os.path.join(root, f"results_{pp}_{dp}.json"), "w") as f:
            json.dump(gathered, f)


def dataclasses_replace(policy, model):
    import dataclasses

    return dataclasses.replace(policy, pipeline=model)


STEP_LR = 1e-2


def _two_rank_extras(rank, root, model_dir, parallel, data, refs, specs):
    """Critic, shape guard, optimizer step, checkpoint and export on the (pp=2, dp=1) layout."""
    import dataclasses

    from ballast.engine.pipeline import PipelineEngine
    from ballast.engine.pipeline.slots import HeadOptions, pack_slot

    out = []
    critic = PipelineEngine(EngineConfig(model_path=os.path.join(model_dir, "..", "critic"), role="critic",
                                         pipeline=PipelineSpec(2, 1, "1f1b")), parallel=parallel)
    plan = critic.plan_micro_batches(data, specs["dynamic-tight"])
    metrics = critic.forward_backward_batch(data, value_loss, plan)
    ref_loss, ref_values, ref_grads = refs["critic"]
    values = critic.infer_batch(data, plan)["values"]
    out.append(dict(extra="critic", loss=metrics["loss"], ref_loss=ref_loss, grad_diffs=_grad_diffs(critic, ref_grads),
                    ref_grad_norm=math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref_grads.values())),
                    value_diff=float((values - ref_values).abs().max())))

    # the shape guard: micro-batches packed into 32-token slots handed to stages built for 64
    engine = PipelineEngine(EngineConfig(model_path=model_dir, pipeline=PipelineSpec(2, 1, "1f1b"),
                                         optim=OptimConfig(lr=STEP_LR)), parallel=parallel)
    plan = engine.plan_micro_batches(data, MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64))
    engine.forward_backward_batch(data, partial(rl_loss, mode="token-mean"), plan, temperature=TEMPERATURE,
                                  calculate_entropy=True)  # builds and runs the 64-token stages
    engine.zero_grad()
    head = HeadOptions(is_critic=False)
    small = [pack_slot(data[torch.as_tensor(rows)], torch.as_tensor(rows), 64, head) for rows in plan.for_rank(0)]
    shrunk = [dataclasses.replace(mb, input_ids=mb.input_ids[:, :32],
                                  slot=dataclasses.replace(mb.slot, position_ids=mb.slot.position_ids[:, :32]))
              for mb in small]
    try:
        engine.runner.run(shrunk, 64, head.output_rows, None)
        guard = None
    except ValueError as err:
        guard = str(err)
    out.append(dict(extra="guard", message=guard))

    # one optimizer step, against the reference AdamW step; then a checkpoint round trip
    metrics = engine.forward_backward_batch(data, partial(rl_loss, mode="token-mean"), plan, temperature=TEMPERATURE,
                                            calculate_entropy=True)
    step = engine.optimizer_step()
    expected = torch.load(os.path.join(root, "stepped.pt"), weights_only=True)
    stepped = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    step_diff = max(float((t - expected[TIED if n == "lm_head.weight" else n]).abs().max()) for n, t in stepped.items())
    ckpt_dir = os.path.join(root, "ckpt")
    engine.save_checkpoint(ckpt_dir)
    engine.forward_backward_batch(data, partial(rl_loss, mode="token-mean"), plan, temperature=TEMPERATURE,
                                  calculate_entropy=True)
    engine.optimizer_step()
    second = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.load_checkpoint(ckpt_dir)
    reloaded = max(float((p.detach() - stepped[n]).abs().max()) for n, p in engine.model.named_parameters())
    engine.forward_backward_batch(data, partial(rl_loss, mode="token-mean"), plan, temperature=TEMPERATURE,
                                  calculate_entropy=True)
    engine.optimizer_step()
    resumed = max(float((p.detach() - second[n]).abs().max()) for n, p in engine.model.named_parameters())
    full = {n: t.clone() for n, t in engine.iter_full_state_dict()}
    engine.export_hf(os.path.join(root, "export"))
    other = PipelineEngine(EngineConfig(model_path=model_dir, pipeline=PipelineSpec(2, 2, "interleaved_1f1b")),
                           parallel=parallel)
    try:
        other.load_checkpoint(ckpt_dir)
        refused = None
    except ValueError as err:
        refused = str(err)
    out.append(dict(extra="step", grad_norm=step["grad_norm"], ref_grad_norm=float(expected["__grad_norm__"]),
                    step_diff=step_diff, reloaded=reloaded, resumed=resumed, refused=refused,
                    full_names=sorted(full), tied_equal=bool(torch.equal(full[TIED], full["lm_head.weight"])),
                    full_sum=float(sum(t.double().abs().sum() for t in full.values()))))
    return out


def _failures(results, where):
    failures = []
    for r in results:
        at = f"{where} {r.get('schedule', r.get('extra'))} v={r.get('v')} {r.get('cut', '')} {r.get('mode', '')}"
        if abs(r["loss"] - r["ref_loss"]) > REL_TOL * max(1.0, abs(r["ref_loss"])):
            failures.append(f"{at}: loss {r['loss']:.8g} != reference {r['ref_loss']:.8g}")
        worst = max(r["grad_diffs"].values())
        if worst > REL_TOL * r["ref_grad_norm"]:
            failures.append(f"{at}: max |grad diff| {worst:.3g} > {REL_TOL} * {r['ref_grad_norm']:.3g}")
        for key in ("lp_diff", "ent_diff", "value_diff"):
            if key in r and r[key] > REL_TOL:
                failures.append(f"{at}: {key} {r[key]:.3g}")
        if "entropy" in r and abs(r["entropy"] - r["ref_entropy"]) > REL_TOL * max(1.0, abs(r["ref_entropy"])):
            failures.append(f"{at}: entropy metric {r['entropy']:.8g} != reference {r['ref_entropy']:.8g}")
    return failures


def _covered(per_rank, key="schedule"):
    """Reference parameter names whose gradient some rank compared, per configuration."""
    names = {}
    for results in per_rank:
        for r in results:
            if "grad_diffs" in r:
                names.setdefault((r.get(key), r.get("v"), r.get("cut"), r.get("extra")), set()).update(r["grad_diffs"])
    return names


@pytest.mark.parametrize("pp, dp", list(LAYOUTS), ids=lambda v: str(v))
def test_pipeline_gradients_equal_the_single_process_reference(problem, pp, dp):
    root, model_dir = problem
    spawn_ranks(_pipeline_worker, pp * dp, args=(root, model_dir, pp), timeout_s=300)
    with open(os.path.join(root, f"results_{pp}_{dp}.json")) as f:
        per_rank = json.load(f)
    refs = torch.load(os.path.join(root, "ref.pt"), weights_only=False)
    every = set(refs["token-mean"][2])
    for config, names in _covered(per_rank).items():
        expected = set(refs["critic"][2]) if config[3] == "critic" else every
        assert names == expected, (config, sorted(expected - names))
    matrix = [r for results in per_rank for r in results if "extra" not in r]
    assert len(matrix) == pp * dp * len(LAYOUTS[(pp, dp)]) * len(CUTS)
    assert {r["mode"] for r in matrix} == set(LOSS_AGG_MODES)
    assert all(r["num_micro_batches"] >= pp for r in matrix)
    failures = _failures([r for results in per_rank for r in results if "loss" in r], f"pp={pp} dp={dp}")
    assert not failures, "\n".join(failures)
    assert all(0.0 <= r["bubble"] < 1.0 and 0.0 <= r["predicted"] < 1.0 for r in matrix)
    if (pp, dp) == (2, 1):
        _check_extras(per_rank, root, model_dir)


def _check_extras(per_rank, root, model_dir):
    from transformers import AutoModelForCausalLM

    guards = [r for results in per_rank for r in results if r.get("extra") == "guard"]
    assert len(guards) == 2 and all(g["message"] and "pipeline micro-batch 0 has" in g["message"] for g in guards)
    steps = [r for results in per_rank for r in results if r.get("extra") == "step"]
    assert len(steps) == 2
    for step in steps:
        assert step["grad_norm"] == pytest.approx(step["ref_grad_norm"], rel=1e-5)
        # the reference's AdamW update, per stage: a first Adam step divides each entry by its own size,
        # so entries whose gradient is near eps turn the gradients' rounding (checked above) into up to
        # a fraction of lr
        assert step["step_diff"] <= 0.01 * STEP_LR, step["step_diff"]
        assert step["reloaded"] == 0.0 and step["resumed"] == 0.0  # a resume repeats the step exactly
        assert step["refused"] and "pipeline layout" in step["refused"]
        assert step["tied_equal"]
    assert steps[0]["full_names"] == steps[1]["full_names"] and steps[0]["full_sum"] == steps[1]["full_sum"]
    stepped = torch.load(os.path.join(root, "stepped.pt"), weights_only=True)
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(root, "export"), dtype=torch.float32)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    # the export holds the weights after the second step (a step further than `stepped`), every stage's
    assert set(exported.state_dict()) == set(steps[0]["full_names"])
    moved = max(float((p.detach() - stepped[n]).abs().max()) for n, p in exported.named_parameters())
    assert 0 < moved < 0.1
