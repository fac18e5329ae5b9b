"""THE invariance guarantee: loss and full gradient of one mini-batch equal the single-process
plain-PyTorch reference for every (dp, sp) layout, micro-batch cut, remove-padding setting and loss
aggregation mode (plus activation checkpointing on one cut, parameters kept gathered between forward
and backward, `reshard_after_forward=False`, on three cuts, and with more than one rank, hybrid sharding
with a whole replica per rank, `fsdp_size=1`, on three cuts), and with a central plan
(`plan_phase` over the whole mini-batch, as the trainer's driver makes) instead of per-rank planning.
The same holds for a LoRA adapter (PEFT, base frozen): its gradient equals the reference PEFT model's
on several cuts of every layout, with and without remove-padding and checkpointing, and under DDP.

One process group is launched per (dp, sp) layout; inside it every configuration runs against
references computed once, here, with an unmodified transformers model (sdpa attention), each sample
alone and unpadded, and the loss written from its definition over the whole mini-batch. Each cut of
a configuration runs under two of the four loss aggregation modes, rotated over the cuts and the
layouts (`_modes`): every cut of every configuration meets every mode on the layouts it runs on, and
every layout meets every mode; the whole product would double the cost and test no new code path.

Tolerance (fp32): |loss - ref| <= 1e-5 * max(1, |ref|) and
max_i |grad_i - ref_i| <= 1e-5 * ||ref grad||_2 over all parameters.
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

from ballast.balance import plan_phase
from ballast.engine import EngineConfig, MicroBatchSpec, TrainEngine
from ballast.engine.config import LoraSpec
from ballast.engine.lora import attach_adapter, save_adapter
from ballast.engine.losses import LOSS_AGG_MODES, agg_loss
from testkit.engine import full, make_rl_batch, reference_log_probs, spawn_ranks, whole_batch_loss
from testkit.models import build_tiny_causal_lm

# Progress bars start tqdm's monitor thread; without it the ranks can be forked (fast).
transformers.utils.logging.disable_progress_bar()

TEMPERATURE = 0.9
ENTROPY_COEF = 0.01
REL_TOL = 1e-5
NUM_SAMPLES = 16


def rl_loss(outputs, micro, norm, mode):
    """A PPO-like surrogate with an entropy bonus; metric `entropy` is the mini-batch token mean."""
    mask = micro["response_mask"]
    loss_mat = -micro["advantages"] * outputs["log_probs"] - ENTROPY_COEF * outputs["entropy"]
    return agg_loss(loss_mat, mask, mode, norm), {"entropy": agg_loss(outputs["entropy"], mask, "token-mean", norm)}


def _lengths():
    """16 samples, total lengths 3..120 spread log-uniformly; one with an empty response."""
    rng = np.random.default_rng(1234)
    totals = np.unique(np.round(np.exp(np.linspace(np.log(3), np.log(120), NUM_SAMPLES))).astype(int))
    totals = np.concatenate([totals, rng.integers(3, 121, NUM_SAMPLES - len(totals))])
    rng.shuffle(totals)
    prompts = np.maximum(1, np.round(totals * rng.uniform(0.2, 0.6, NUM_SAMPLES))).astype(int)
    responses = totals - prompts
    responses[int(np.argmin(totals))] = 0
    return prompts.tolist(), responses.tolist()


def _reference(model_dir, data, adapter_dir=None):
    """{mode: (loss, entropy metric, {name: grad})} from an unmodified model (with the PEFT adapter in
    `adapter_dir`, if given: gradients of the adapter only), one sample at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if adapter_dir is not None:
        attach_adapter(model, LoraSpec(adapter_path=adapter_dir), "actor")
    R = data["responses"].shape[1]
    mask = data["response_mask"].float()
    refs = {}
    for mode in LOSS_AGG_MODES:
        model.zero_grad(set_to_none=True)
        lp, ent = reference_log_probs(model, data, TEMPERATURE)
        loss_mat = -data["advantages"] * lp - ENTROPY_COEF * ent
        loss = whole_batch_loss(loss_mat, mask, mode, horizon=R)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        entropy_metric = float((ent.detach() * mask).sum() / mask.sum())
        refs[mode] = (float(loss.detach()), entropy_metric, grads)
    return refs


def _write_adapter(model_dir, path):
    """A rank-4 all-linear adapter with non-zero B (a fresh one has B = 0, which makes A's gradient 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapter = attach_adapter(model, LoraSpec(rank=4, alpha=8), "actor", seed=5)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    save_adapter(path, model.state_dict().items(), adapter)
    return path


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    model_dir = build_tiny_causal_lm(str(root / "model"), seed=7, tie_word_embeddings=True)
    adapter_dir = _write_adapter(model_dir, str(root / "adapter"))
    prompts, responses = _lengths()
    data = make_rl_batch(prompts, responses, vocab_size=128, seed=11)
    torch.save(data.to_dict(), root / "data.pt")
    torch.save(_reference(model_dir, data), root / "ref.pt")
    torch.save(_reference(model_dir, data, adapter_dir), root / "ref_lora.pt")
    return str(root), model_dir


SPEC_NAMES = ("static-1", "static-2", "static-all", "dynamic-tight", "dynamic-loose", "dynamic-bucketed",
              "central-tight")


def _specs(local_rows: int, lengths: np.ndarray, sp: int):
    tight = math.ceil(int(lengths.max()) / sp)
    loose = math.ceil(int(lengths.sum()) / sp)
    return {
        "static-1": MicroBatchSpec(micro_batch_size_per_gpu=1),
        "static-2": MicroBatchSpec(micro_batch_size_per_gpu=2),
        "static-all": MicroBatchSpec(micro_batch_size_per_gpu=local_rows),
        "dynamic-tight": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=tight),
        "dynamic-loose": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=loose),
        # length bucketing (the tuning guide's dynamic_bsz_bucketing): no micro-batch mixes prompt
        # lengths <= 8, 9..24 and > 24 tokens
        "dynamic-bucketed": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=max(tight, loose // 3),
                                           bucket_boundaries=(8, 24)),
        # the same budget as dynamic-tight, but the driver's central plan picks ranks and micro-batches
        "central-tight": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=tight),
    }


def _runs(world, sp):
    """(rmpad, checkpointing, reshard_after_forward, fsdp_size, spec names, LoRA) of every engine built."""
    runs = [(rmpad, False, True, -1, list(SPEC_NAMES), False) for rmpad in ([True, False] if sp == 1 else [True])]
    runs.append((True, True, True, -1, ["dynamic-tight"], False))  # activation checkpointing on
    # parameters kept gathered from forward to backward (the CPU configs' setting), over several cuts
    runs.append((True, False, False, -1, ["dynamic-tight", "static-1", "central-tight"], False))
    if world > 1:  # hybrid sharding, one whole replica per rank: gradients all-reduced across replicas
        runs.append((True, False, False, 1, ["dynamic-tight", "static-1", "central-tight"], False))
    # LoRA: the adapter's gradient on several cuts, checkpointed with parameters kept gathered, padded
    # with resharding, and (whole replicas) under DDP
    runs.append((True, True, False, -1, ["static-1", "dynamic-tight", "central-tight"], True))
    if sp == 1:
        runs.append((False, False, True, -1, ["static-2", "dynamic-loose"], True))
    else:  # resharding after forward under Ulysses
        runs.append((True, False, True, -1, ["dynamic-tight"], True))
    if world > 1:
        runs.append((True, False, False, 1, ["dynamic-tight", "central-tight"], True))
    return runs


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (dp, sp), in the order the test runs them


def _modes(layouts, dp, sp, run, spec_index):
    """The loss aggregation modes one cut of configuration `run` runs under on layout (dp, sp), when a
    test runs `layouts` (in that order): two, (k, k + 2) with k = the layout's index + the cut's index,
    if `run` also runs on an adjacent layout of the list (which then gives this cut the other two);
    else all four."""
    i = layouts.index((dp, sp))
    neighbours = [layouts[j] for j in (i - 1, i + 1) if 0 <= j < len(layouts)]
    if not any(run in _runs(d * s, s) for d, s in neighbours):
        return LOSS_AGG_MODES
    k = i + spec_index
    return LOSS_AGG_MODES[k % 4], LOSS_AGG_MODES[(k + 2) % 4]


def _invariance_worker(rank, world, root, model_dir, sp, layouts, with_lora=True):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    data_dict = torch.load(os.path.join(root, "data.pt"), weights_only=True)
    data = TensorDict(data_dict, batch_size=[NUM_SAMPLES])
    refs = {False: torch.load(os.path.join(root, "ref.pt"), weights_only=True)}
    if with_lora:
        refs[True] = torch.load(os.path.join(root, "ref_lora.pt"), weights_only=True)
    parallel = build_parallel_state(sp, "cpu")
    rows = NUM_SAMPLES // parallel.dp_size
    local = data[parallel.dp_rank * rows : (parallel.dp_rank + 1) * rows]
    lengths = data["attention_mask"].sum(-1).numpy()
    specs = _specs(rows, lengths, sp)
    central = plan_phase(lengths, parallel.dp_size, specs["central-tight"].policy(sp))
    central_local = data[torch.as_tensor(central.rank_rows(parallel.dp_rank))]
    results = []
    for run in _runs(world, sp):
        rmpad, checkpointing, reshard, fsdp_size, spec_names, lora = run
        if lora and not with_lora:
            continue
        cfg = EngineConfig(
            model_path=model_dir, use_remove_padding=rmpad, ulysses_sequence_parallel_size=sp,
            enable_activation_checkpointing=checkpointing, reshard_after_forward=reshard, fsdp_size=fsdp_size,
            lora=LoraSpec(adapter_path=os.path.join(root, "adapter")) if lora else LoraSpec(),
        )
        engine = TrainEngine(cfg, parallel=parallel if fsdp_size == -1 else build_parallel_state(sp, "cpu", fsdp_size))
        for spec_index, spec_name in enumerate(spec_names):
            spec = specs[spec_name]
            if spec_name == "central-tight":
                batch, plan = central_local, central.mini_batches[0]
            else:
                batch = local
                plan = engine.plan_micro_batches(batch, spec)
            for mode in _modes(layouts, parallel.dp_size, sp, run, spec_index):
                metrics = engine.forward_backward_batch(
                    batch, partial(rl_loss, mode=mode), plan, temperature=TEMPERATURE, calculate_entropy=True,
                )
                grads = {n: full(p.grad) for n, p in engine.model.named_parameters() if p.requires_grad}
                engine.zero_grad()
                ref_loss, ref_entropy, ref_grads = refs[lora][mode]
                assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
                ref_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref_grads.values()))
                max_diff = max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads)
                results.append(dict(
                    lora=lora, rmpad=rmpad, checkpointing=checkpointing, reshard=reshard, fsdp_size=fsdp_size, spec=spec_name,
                    data_parallel=engine.data_parallel_mode, mode=mode, loss=metrics["loss"], ref_loss=ref_loss,
                    entropy=metrics["entropy"], ref_entropy=ref_entropy, max_grad_diff=max_diff,
                    ref_grad_norm=ref_norm, num_micro_batches=metrics["num_micro_batches"],
                    planned=central.mini_batches[0].num_micro_batches,
                ))
    if rank == 0:
        with open(os.path.join(root, f"results_{world}_{sp}.json"), "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("dp, sp", LAYOUTS, ids=lambda v: str(v))
def test_loss_and_gradient_equal_the_single_process_reference(problem, dp, sp):
    root, model_dir = problem
    spawn_ranks(_invariance_worker, dp * sp, args=(root, model_dir, sp, LAYOUTS), timeout_s=240)
    with open(os.path.join(root, f"results_{dp * sp}_{sp}.json")) as f:
        results = json.load(f)
    expected_runs = sum(len(run[4]) for run in _runs(dp * sp, sp)) * 2  # every configuration has a neighbour (_modes)
    assert len(results) == expected_runs
    assert sum(r["lora"] for r in results) == (3 + (2 if sp == 1 else 1) + (2 if dp * sp > 1 else 0)) * 2
    assert {r["mode"] for r in results} == set(LOSS_AGG_MODES)
    failures = []
    for r in results:
        where = (f"dp={dp} sp={sp} lora={r['lora']} rmpad={r['rmpad']} ckpt={r['checkpointing']} reshard={r['reshard']} "
                 f"fsdp_size={r['fsdp_size']} {r['spec']} {r['mode']}")
        if abs(r["loss"] - r["ref_loss"]) > REL_TOL * max(1.0, abs(r["ref_loss"])):
            failures.append(f"{where}: loss {r['loss']:.8g} != reference {r['ref_loss']:.8g}")
        if r["max_grad_diff"] > REL_TOL * r["ref_grad_norm"]:
            failures.append(f"{where}: max |grad diff| {r['max_grad_diff']:.3g} > {REL_TOL} * {r['ref_grad_norm']:.3g}")
        if abs(r["entropy"] - r["ref_entropy"]) > REL_TOL * max(1.0, abs(r["ref_entropy"])):
            failures.append(f"{where}: entropy metric {r['entropy']:.8g} != reference {r['ref_entropy']:.8g}")
    assert not failures, "\n".join(failures)
    # the matrix really exercised different cuts: 1-sample micro-batches vs one micro-batch
    counts = {r["spec"]: r["num_micro_batches"] for r in results if not r["lora"]}
    assert any(not r["reshard"] for r in results)
    assert any(r["fsdp_size"] == 1 for r in results) == (dp * sp > 1)
    # whole replicas (fsdp_size=1, or a single rank) run under DDP (summing hook); the rest under FSDP2
    assert all(r["data_parallel"] == ("ddp" if r["fsdp_size"] == 1 or dp * sp == 1 else "fsdp") for r in results)
    assert any(r["checkpointing"] for r in results)
    assert counts["static-1"] == NUM_SAMPLES // dp and counts["static-all"] == 1
    assert counts["dynamic-tight"] > counts["dynamic-loose"]
    assert counts["dynamic-bucketed"] >= 3 > counts["dynamic-loose"]  # three buckets, never mixed
    assert counts["central-tight"] == results[0]["planned"] > 1  # the engine ran the central plan's cut


# ------------------------------------------------------------------------------------ rollout correction
# Every correction mode x loss aggregation mode over the cuts, against the actor loss on the whole
# mini-batch in one piece under the plain model. Decoupled modes carry driver-made weights, masks and
# normaliser terms; bypass modes compute theirs in the loss from the policy being trained, the batch
# normaliser from a forward-only pass over the mini-batch that the engine sums over the DP group.
CORRECTION_MODES = [
    ("dec-token-tis", dict(rollout_is="token", rollout_is_threshold=1.5)),
    ("dec-seq-is-norm", dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)),
    ("dec-token-icepop-norm-seqsum-rs", dict(rollout_is="token", rollout_is_threshold="0.6_1.6",
                                             rollout_is_batch_normalize=True, rollout_rs="seq_sum_k1",
                                             rollout_rs_threshold="0.3_3.0")),
    ("dec-rs-token-k1-seq-max-k3", dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.6_1.6,0.5")),
    ("bypass-ppo-clip-seq-mean-k3", dict(bypass_mode=True, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.045)),
    ("bypass-pg-seq-tis", dict(bypass_mode=True, loss_type="reinforce", rollout_is="sequence")),
    ("bypass-pg-token-icepop-norm", dict(bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                         rollout_is_threshold="0.6_1.6", rollout_is_batch_normalize=True)),
    ("bypass-pg-seq-norm-rs", dict(bypass_mode=True, loss_type="reinforce", rollout_is="sequence",
                                   rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                                   rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="0.08,0.7_1.4")),
    # Ballast's extensions: probability-difference and binary-KL token masks, an outlier-sequence mask
    ("bypass-ppo-clip-tv-bkl-outlier", dict(bypass_mode=True, rollout_rs="token_tv,token_bkl,seq_max_absk1",
                                            rollout_rs_threshold="0.003,0.0004,2.5")),
]
CORRECTION_SPECS = ("static-1", "static-all", "dynamic-tight", "central-tight")


def _corrected(data, lp, name, mode):
    """(mini-batch with the columns the loss reads, the actor loss) for one correction mode."""
    from ballast.trainer.algorithms.policy_loss import ActorLossConfig, make_actor_loss
    from ballast.trainer.algorithms.rollout_correction import correct, normaliser_terms, parse_rollout_correction
    from ballast.trainer.step.rollout_correction import loss_correction

    corr = parse_rollout_correction(**dict(CORRECTION_MODES)[name])
    data = data.clone()
    gen = torch.Generator().manual_seed(3)
    mask = data["response_mask"]
    data["rollout_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=gen)) * mask
    if corr.bypass_mode:
        data["old_log_probs"] = data["rollout_log_probs"].clone()
    else:  # what the driver does after the old-log-prob pass
        data["old_log_probs"] = (lp + 0.05 * torch.randn(lp.shape, generator=gen)) * mask
        c = correct(data["old_log_probs"], data["rollout_log_probs"], mask, corr)
        if c.weights is not None:
            data["rollout_is_weights"] = c.weights.weights
            terms = normaliser_terms(c.weights.weights, mask, corr.rollout_is)
            data["rollout_is_norm_sum"], data["rollout_is_norm_count"] = terms[:, 0].clone(), terms[:, 1].clone()
        data["response_mask"] = c.mask
    cfg = ActorLossConfig(loss_agg_mode=mode, entropy_coeff=ENTROPY_COEF, rollout_correction=loss_correction(corr))
    return data, make_actor_loss(cfg)


def _correction_reference(model_dir, data):
    """{(name, agg mode): (loss, {param: grad})}: the whole mini-batch as one micro-batch, plain model."""
    from transformers import AutoModelForCausalLM

    from ballast.engine.losses import GlobalNorm, mini_batch_statistic

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        base_lp, _ = reference_log_probs(model, data, TEMPERATURE)
    _check_modes_bite(data, base_lp)
    refs = {}
    for name, _ in CORRECTION_MODES:
        for mode in LOSS_AGG_MODES:
            batch, loss_fn = _corrected(data, base_lp, name, mode)
            model.zero_grad(set_to_none=True)
            lp, ent = reference_log_probs(model, batch, TEMPERATURE)
            norm = GlobalNorm.local(batch["response_mask"])
            stat = mini_batch_statistic(loss_fn)
            if stat is not None:
                parts = stat({"log_probs": lp.detach()} if stat.needs_outputs else None, batch)
                norm = norm.with_stats(dict(zip(stat.keys, [float(p) for p in parts])))
            loss, _ = loss_fn({"log_probs": lp, "entropy": ent}, batch, norm)
            loss.backward()
            refs[(name, mode)] = (float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return refs, base_lp


def _check_modes_bite(data, base_lp):
    """Every mode's weights and rejection really change something here (else the matrix proves little)."""
    from ballast.trainer.algorithms.rollout_correction import correct, parse_rollout_correction

    for name, settings in CORRECTION_MODES:
        corr = parse_rollout_correction(**settings)
        batch, _ = _corrected(data, base_lp, name, "token-mean")
        train = base_lp if corr.bypass_mode else batch["old_log_probs"]
        c = correct(train, batch["rollout_log_probs"], data["response_mask"], corr)
        mask = data["response_mask"].bool()
        if corr.rejection:
            kept = float(c.mask.sum()) / float(mask.sum())
            assert 0.05 < kept < 0.95, (name, kept)
        if c.weights is not None:
            w = c.weights.weights[mask]
            clipped = (w == corr.is_upper) | (w == 0) if corr.rollout_is == "token" or corr.is_lower else w == corr.is_upper
            assert 0 < float(clipped.float().mean()) < 1, (name, float(clipped.float().mean()))


@pytest.fixture(scope="module")
def correction_problem(problem):
    root, model_dir = problem
    data = _load_data(os.path.join(root, "data.pt"))
    refs, base_lp = _correction_reference(model_dir, data)
    torch.save(base_lp, os.path.join(root, "base_lp.pt"))
    torch.save({f"{k[0]}|{k[1]}": v for k, v in refs.items()}, os.path.join(root, "correction_ref.pt"))
    return root, model_dir


def _load_data(path):
    """The mini-batch `problem` saved."""
    from tensordict import TensorDict

    return TensorDict(torch.load(path, weights_only=True), batch_size=[NUM_SAMPLES])


def _correction_cases(rmpads, dp, sp):
    """Correction mode x loss aggregation mode pairs, each under one cut and remove-padding setting,
    rotated so that every mode meets every cut and both settings, and so does every aggregation
    mode: the whole cross product would cost minutes and test no new code path. Each pair runs on
    two of the four layouts, (1, 1) and (2, 2) or (2, 1) and (1, 2): under both dp sizes and both sp
    sizes; every layout still runs every correction mode, aggregation mode, cut and setting."""
    diagonal = (dp, sp) in ((1, 1), (2, 2))
    for i, mode_entry in enumerate(CORRECTION_MODES):
        for j, mode in enumerate(LOSS_AGG_MODES):
            if ((i + j // 2) % 2 == 0) == diagonal:
                yield mode_entry, mode, CORRECTION_SPECS[(i + j) % len(CORRECTION_SPECS)], rmpads[j % len(rmpads)]


def _correction_worker(rank, world, root, model_dir, sp):
    from ballast.engine.dist import build_parallel_state

    data = _load_data(os.path.join(root, "data.pt"))
    base_lp = torch.load(os.path.join(root, "base_lp.pt"), weights_only=True)
    refs = torch.load(os.path.join(root, "correction_ref.pt"), weights_only=True)
    parallel = build_parallel_state(sp, "cpu")
    rows = NUM_SAMPLES // parallel.dp_size
    lengths = data["attention_mask"].sum(-1).numpy()
    specs = _specs(rows, lengths, sp)
    central = plan_phase(lengths, parallel.dp_size, specs["central-tight"].policy(sp))
    rmpads = [True, False] if sp == 1 else [True]
    engines = {rmpad: TrainEngine(EngineConfig(model_path=model_dir, use_remove_padding=rmpad,
                                               ulysses_sequence_parallel_size=sp), parallel=parallel)
               for rmpad in rmpads}
    results = []
    for (name, _), mode, spec_name, rmpad in _correction_cases(rmpads, parallel.dp_size, sp):
        engine = engines[rmpad]
        whole, loss_fn = _corrected(data, base_lp, name, mode)
        ref_loss, ref_grads = refs[f"{name}|{mode}"]
        ref_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref_grads.values()))
        if spec_name == "central-tight":
            batch, plan = whole[torch.as_tensor(central.rank_rows(parallel.dp_rank))], central.mini_batches[0]
        else:
            batch = whole[parallel.dp_rank * rows:(parallel.dp_rank + 1) * rows]
            plan = engine.plan_micro_batches(batch, specs[spec_name])
        metrics = engine.forward_backward_batch(batch, loss_fn, plan, temperature=TEMPERATURE, calculate_entropy=True)
        grads = {n: full(p.grad) for n, p in engine.model.named_parameters()}
        engine.zero_grad()
        max_diff = max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads)
        results.append(dict(rmpad=rmpad, spec=spec_name, name=name, mode=mode, loss=metrics["loss"],
                            ref_loss=ref_loss, max_grad_diff=max_diff, ref_grad_norm=ref_norm))
    if rank == 0:
        with open(os.path.join(root, f"correction_{world}_{sp}.json"), "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("dp, sp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda v: str(v))
def test_rollout_correction_modes_equal_the_single_process_reference(correction_problem, dp, sp):
    root, model_dir = correction_problem
    spawn_ranks(_correction_worker, dp * sp, args=(root, model_dir, sp), timeout_s=600)
    with open(os.path.join(root, f"correction_{dp * sp}_{sp}.json")) as f:
        results = json.load(f)
    assert len(results) == len(list(_correction_cases([True, False] if sp == 1 else [True], dp, sp)))
    assert {r["spec"] for r in results} == set(CORRECTION_SPECS) and len({r["rmpad"] for r in results}) == (2 if sp == 1 else 1)
    assert {r["name"] for r in results} == {name for name, _ in CORRECTION_MODES}
    assert {r["mode"] for r in results} == set(LOSS_AGG_MODES)
    failures = []
    for r in results:
        where = f"dp={dp} sp={sp} rmpad={r['rmpad']} {r['spec']} {r['name']} {r['mode']}"
        if abs(r["loss"] - r["ref_loss"]) > REL_TOL * max(1.0, abs(r["ref_loss"])):
            failures.append(f"{where}: loss {r['loss']:.8g} != reference {r['ref_loss']:.8g}")
        if r["max_grad_diff"] > REL_TOL * r["ref_grad_norm"]:
            failures.append(f"{where}: max |grad diff| {r['max_grad_diff']:.3g} > {REL_TOL} * {r['ref_grad_norm']:.3g}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
