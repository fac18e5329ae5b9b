"""Ballast's RL math against verl 0.9.1's own functions, on random inputs and masks, to 1e-6.

verl is installed by scripts/setup.sh (`pip install --no-deps verl==0.9.1`); only its pure-Python
modules are imported (core_algos, metric_utils, torch_functional, the config dataclasses). A
deliberate, documented difference is a test that pins it (the warmup ramp; clip_cov / kl_cov are not
offered; geo_mean's sum over micro-batches). Where verl (or codetiming/orjson, which its core_algos
imports) is not installed, as in the GPU Docker image, the whole module is skipped at collection,
never an error that stops the rest of the suite (tests/unit/test_collection.py pins it).
"""

import numpy as np
import pytest
import torch

from ballast.engine import OptimConfig as EngineOptim
from ballast.engine.losses import LOSS_AGG_MODES, GlobalNorm
from ballast.engine.optim import lr_factor
from ballast.protocol import Batch
from ballast.trainer.algorithms import get_adv_estimator, kl_penalty, make_kl_controller
from ballast.trainer.algorithms.policy_loss import POLICY_LOSSES, ActorLossConfig, CriticLossConfig, critic_loss
from ballast.trainer.step.metrics import data_metrics

# Without verl the whole module is skipped here, at collection (a skip, not a collection error).
V = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.1 is not installed (bash scripts/setup.sh "
                        "installs it): the verl parity tests need it as their reference")
import verl.utils.torch_functional as VF  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.metric_utils import compute_data_metrics  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-6)
B, R = 12, 7


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=gen)
    mask = (torch.arange(R)[None] < lengths[:, None]).float()  # right-padded responses, >= 1 token
    uids = np.array([f"p{i // 3}" for i in range(B - 1)] + ["single"], dtype=object)  # groups of 3, one of 1
    return gen, mask, uids


def _holed_inputs(seed, width=24):
    """Multi-turn masks: per row, 1 to 3 mask-0 spans (tool tokens, rejected tokens) at random places
    between response tokens, and right padding; the first and last columns of a hole-free row too."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, width)
    for row in range(B):
        length = int(torch.randint(width // 2, width + 1, (1,), generator=gen))
        mask[row, :length] = 1.0
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            start = int(torch.randint(1, length - 1, (1,), generator=gen))
            span = int(torch.randint(1, 4, (1,), generator=gen))
            mask[row, start:min(start + span, length - 1)] = 0.0  # keeps the row's first and last token
    uids = np.array([f"p{i // 3}" for i in range(B - 1)] + ["single"], dtype=object)
    return gen, mask, uids


@pytest.mark.parametrize("layout", ["right_padded", "holes"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["grpo", "grpo_unnormalised", "rloo", "reinforce_plus_plus",
                                  "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg", "gae"])
def test_advantage_estimators_match_verl(name, seed, layout):
    """`holes`: mask-0 spans inside responses, where verl carries the running return, the next value
    and the GAE accumulator through; rewards and values there are noise that must not matter."""
    gen, mask, uids = _inputs(seed) if layout == "right_padded" else _holed_inputs(seed)
    width = mask.shape[1]
    if layout == "holes":
        assert ((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any(dim=1).all()  # every row has an interior hole
    noise = 1.0 if layout == "holes" else 0.0
    rewards = torch.randn(B, width, generator=gen, dtype=torch.float64) * (mask + noise * (1 - mask))
    values = torch.randn(B, width, generator=gen, dtype=torch.float64) * (mask + noise * (1 - mask))
    if name == "grpo_passk":  # groups of one are an error in both
        mask, uids, rewards, values = mask[:-1], uids[:-1], rewards[:-1], values[:-1]
    gamma, lam, norm_std = 0.97, 0.9, name != "grpo_unnormalised"
    algo = AlgoConfig(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_std)
    verl_name = "grpo" if name == "grpo_unnormalised" else name
    kwargs = dict(token_level_rewards=rewards.clone(), response_mask=mask.double())
    if verl_name == "gae":
        want = V.compute_gae_advantage_return(values=values.clone(), gamma=gamma, lam=lam, **kwargs)
    elif verl_name == "grpo":
        want = V.compute_grpo_outcome_advantage(index=uids, norm_adv_by_std_in_grpo=norm_std, **kwargs)
    else:
        want = V.get_adv_estimator_fn(verl_name)(index=uids, config=algo, **kwargs)
    got = get_adv_estimator(verl_name)(token_level_rewards=rewards.clone(), response_mask=mask.double(), index=uids,
                                       values=values.clone(), gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_std)
    for g, w in zip(got, want):
        torch.testing.assert_close(g * mask, w * mask, **TOL)


def _actor_cfg(mode, agg, clip_low=0.2, clip_high=0.28, scale=None):
    verl_cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                               clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=3.0,
                               loss_agg_mode=agg)
    ours = ActorLossConfig(loss_mode=mode, clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=3.0,
                           loss_agg_mode=agg, loss_scale_factor=scale)
    return verl_cfg, ours


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "geo_mean"])
def test_policy_losses_and_aggregation_match_verl(mode, agg):
    """One call of verl's loss on the whole mini-batch (for geo_mean that is verl with one micro-batch
    per mini-batch; its micro-batched sum is the next test)."""
    gen, mask, _ = _inputs(3)
    mask[4] = 0.0  # a fully masked row: excluded by both
    old = -torch.rand(B, R, generator=gen, dtype=torch.float64) * 2
    logp_v = (old + 0.3 * torch.randn(B, R, generator=gen, dtype=torch.float64)).requires_grad_()
    logp_b = logp_v.detach().clone().requires_grad_()
    adv = torch.randn(B, R, generator=gen, dtype=torch.float64)
    verl_cfg, ours = _actor_cfg(mode, agg, scale=5.0 if agg == "seq-mean-token-sum-norm" else None)
    # verl's global-batch normalisers for a single rank holding the whole mini-batch
    verl_cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                      loss_scale_factor=ours.loss_scale_factor)
    want, want_metrics = V.get_policy_loss_fn(mode)(old_log_prob=old, log_prob=logp_v, advantages=adv,
                                                     response_mask=mask, loss_agg_mode=agg, config=verl_cfg)
    norm = GlobalNorm(num_tokens=int(mask.sum()), num_sequences=B, response_len=R)
    # Ballast's loss over a cut into micro-batches: the shares must add up to verl's whole-batch loss.
    got, got_metrics = 0.0, {}
    for rows in (slice(0, 5), slice(5, B)):
        part, metrics = POLICY_LOSSES[mode](log_prob=logp_b[rows], old_log_prob=old[rows], advantages=adv[rows],
                                            response_mask=mask[rows], norm=norm, cfg=ours)
        got = got + part
        for key, value in metrics.items():
            got_metrics[key] = got_metrics.get(key, 0.0) + float(torch.as_tensor(value).detach())
    torch.testing.assert_close(got, want, **TOL)
    assert set(want_metrics) <= set(got_metrics)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, abs=1e-6), key
    want.backward()
    got.backward()
    torch.testing.assert_close(logp_b.grad, logp_v.grad, **TOL)


def _geo_mean_problem():
    gen, mask, _ = _inputs(11)
    mask[4] = 0.0  # a fully masked row: a zero loss, counted among the sequences by both
    old = -torch.rand(B, R, generator=gen, dtype=torch.float64) * 2
    logp = old + 0.3 * torch.randn(B, R, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, R).clone()  # sequence-level, as GMPO
    verl_cfg, ours = _actor_cfg("geo_mean", "token-mean")
    return mask, old, logp, adv, verl_cfg, ours


@pytest.mark.parametrize("dp, cuts", [
    (1, [12]), (1, [6, 6]), (1, [3, 3, 3, 3]),      # static micro-batches: k = 1, 2, 4 per rank
    (2, [3, 3, 3, 3]),                               # two DP ranks of 6 rows, k = 2 each
    (1, [5, 7]), (2, [2, 4, 5, 1]),                  # dynamic micro-batches of unequal sizes
])
def test_geo_mean_is_the_exact_mini_batch_mean_and_verls_micro_batched_sum_scales_it(dp, cuts):
    """verl 0.9.1 calls its geo_mean loss once per micro-batch (a mean over that micro-batch's rows,
    ignoring the global batch info), backpropagates each result as is and lets FSDP average gradients
    over the DP ranks. Ballast's micro-batch shares add up to the mean over the whole mini-batch. So
    verl's value and gradient are Ballast's times sum_j N / (dp * m_j) weights: exactly k times for k
    equal micro-batches per rank, the factor documented in docs/config.md."""
    mask, old, logp, adv, verl_cfg, ours = _geo_mean_problem()
    logp_v, logp_b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    norm = GlobalNorm(num_tokens=int(mask.sum()), num_sequences=B, response_len=R)
    bounds = np.cumsum([0] + cuts)
    rows = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    verl_value = 0.0
    ours_value, ours_weighted = 0.0, 0.0
    for r in rows:
        part, _ = V.get_policy_loss_fn("geo_mean")(old_log_prob=old[r], log_prob=logp_v[r], advantages=adv[r],
                                                   response_mask=mask[r], loss_agg_mode="token-mean", config=verl_cfg)
        verl_value = verl_value + part / dp  # FSDP's gradient average over the DP ranks
        share, _ = POLICY_LOSSES["geo_mean"](log_prob=logp_b[r], old_log_prob=old[r], advantages=adv[r],
                                             response_mask=mask[r], norm=norm, cfg=ours)
        ours_value = ours_value + share
        ours_weighted = ours_weighted + share * B / (dp * (r.stop - r.start))
    # Ballast: the mean over all N sequences of the mini-batch, however it is cut
    whole, _ = POLICY_LOSSES["geo_mean"](log_prob=logp.clone(), old_log_prob=old, advantages=adv, response_mask=mask,
                                         norm=norm, cfg=ours)
    torch.testing.assert_close(ours_value.detach(), whole, **TOL)
    torch.testing.assert_close(verl_value.detach(), ours_weighted.detach(), **TOL)
    grad_v, = torch.autograd.grad(verl_value, logp_v)
    grad_b, = torch.autograd.grad(ours_weighted, logp_b, retain_graph=True)
    torch.testing.assert_close(grad_v, grad_b, **TOL)
    per_rank = len(cuts) // dp
    if len(set(cuts)) == 1:  # k equal micro-batches per rank: verl = k x Ballast, value and gradient
        torch.testing.assert_close(verl_value.detach(), per_rank * ours_value.detach(), **TOL)
        grad_ours, = torch.autograd.grad(ours_value, logp_b)
        torch.testing.assert_close(grad_v, per_rank * grad_ours, **TOL)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("scale", [None, 5.0])
def test_entropy_metric_is_verls_loss_agg_mode_aggregate(agg, scale):
    """`actor/entropy` as verl's trainer computes it from the old-log-prob pass: agg_loss over the
    whole batch with the actor's loss_agg_mode and loss_scale_factor (not a token mean)."""
    from ballast.trainer.step.old_log_probs import old_log_prob_metrics

    tensors = _metric_batch(12, use_critic=False)  # holds a row without any response token
    entropy = torch.rand(B, R, generator=torch.Generator().manual_seed(13)) * 3
    want = V.agg_loss(loss_mat=entropy, loss_mask=tensors["response_mask"], loss_agg_mode=agg,
                      loss_scale_factor=scale)
    got = old_log_prob_metrics(Batch({**tensors, "entropy": entropy}),
                               ActorLossConfig(loss_agg_mode=agg, loss_scale_factor=scale))
    assert got["actor/entropy"] == pytest.approx(float(want), abs=1e-6)
    if agg != "token-mean":  # the modes really differ on this batch: the test can tell them apart
        token_mean = V.agg_loss(loss_mat=entropy, loss_mask=tensors["response_mask"], loss_agg_mode="token-mean")
        assert abs(got["actor/entropy"] - float(token_mean)) > 1e-3


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                                  "k1+", "abs+", "k2+", "k3+", "low_var_kl+"])
def test_kl_estimators_and_straight_through_gradients_match_verl(kind):
    gen = torch.Generator().manual_seed(4)
    ref = -torch.rand(B, R, generator=gen, dtype=torch.float64) * 3
    logp_v = (ref + torch.randn(B, R, generator=gen, dtype=torch.float64)).requires_grad_()
    logp_b = logp_v.detach().clone().requires_grad_()
    want, got = V.kl_penalty(logp_v, ref, kind), kl_penalty(logp_b, ref, kind)
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.rand(B, R, generator=gen, dtype=torch.float64)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(logp_b.grad, logp_v.grad, **TOL)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_value_loss_matches_verl(agg):
    gen, mask, _ = _inputs(5)
    vpreds, values, returns = (torch.randn(B, R, generator=gen, dtype=torch.float64) for _ in range(3))
    scale = 3.0 if agg == "seq-mean-token-sum-norm" else None
    want, want_clipfrac = V.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.3, loss_agg_mode=agg,
                                               batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                               loss_scale_factor=scale)
    from tensordict import TensorDict

    micro = TensorDict({"values": values, "returns": returns, "response_mask": mask}, batch_size=[B])
    got, metrics = critic_loss({"values": vpreds}, micro, GlobalNorm.local(mask),
                               cfg=CriticLossConfig(cliprange_value=0.3, loss_agg_mode=agg, loss_scale_factor=scale))
    torch.testing.assert_close(got, want, **TOL)
    assert float(metrics["critic/vf_clipfrac"]) == pytest.approx(float(want_clipfrac), abs=1e-6)


def test_kl_controllers_match_verl():
    ours = make_kl_controller("adaptive", kl_coef=0.05, target_kl=0.02, horizon=500)
    theirs = V.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.02, horizon=500)
    for current_kl, n in [(0.0, 64), (0.5, 64), (0.021, 128), (0.01, 32), (1e-4, 256)]:
        ours.update(current_kl, n)
        theirs.update(current_kl, n)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)
    fixed_ours, fixed_theirs = make_kl_controller("fixed", 0.1, 0.0, 1), V.FixedKLController(0.1)
    fixed_ours.update(3.0, 10)
    fixed_theirs.update(3.0, 10)
    assert fixed_ours.value == fixed_theirs.value == 0.1


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_lr_schedule_over_a_run_matches_verl_after_warmup_and_pins_the_ramp(schedule):
    """The learning rate each training step applies, through Ballast's update loop with four
    mini-batches per step, against verl's scheduler stepped once per update_actor call."""
    from tensordict import TensorDict

    from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
    from testkit.engine import schedule_probe_engine
    from ballast.workers.spec import TrainLoopSpec
    from ballast.workers.train_loop import run_train_loop

    warmup, total, lr = 4, 30, 0.1
    optim = EngineOptim(lr=lr, lr_schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=0.1)
    engine = schedule_probe_engine(optim)
    spec = TrainLoopSpec(loss_fn=lambda *a: None)
    plan = plan_phase([3] * 8, 1, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=1), mini_batch_samples=2)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    theirs = (VF.get_cosine_schedule_with_warmup(opt, warmup, total, min_lr_ratio=0.1) if schedule == "cosine"
              else VF.get_constant_schedule_with_warmup(opt, warmup))
    data = TensorDict({"x": torch.zeros(8, 1)}, batch_size=[8])
    for step in range(total):
        engine.seen_lrs.clear()
        run_train_loop(engine, data, plan, spec, prefix="actor")
        verl_lr = opt.param_groups[0]["lr"]  # what verl's update_actor applies at this step
        assert len(set(engine.seen_lrs)) == 1  # one learning rate for every mini-batch of the step
        if step >= warmup:
            assert engine.seen_lrs[0] == pytest.approx(verl_lr, abs=1e-12), step
        else:  # deliberate: Ballast's ramp is (s+1)/w (no step at lr 0), verl's s/w
            assert engine.seen_lrs[0] == pytest.approx(lr * (step + 1) / warmup)
            assert verl_lr == pytest.approx(lr * step / warmup)
        opt.step()
        theirs.step()
    assert lr_factor(warmup - 1, optim) == 1.0


def _metric_batch(seed, use_critic):
    gen = torch.Generator().manual_seed(seed)
    P = 6
    prompt_len = torch.randint(1, P + 1, (B,), generator=gen)
    prompt_len[0] = P
    resp_len = torch.randint(0, R + 1, (B,), generator=gen)
    resp_len[1], resp_len[2] = 0, R  # an aborted sample and a clipped one
    pos = torch.arange(P + R)[None]
    attention = ((pos >= P - prompt_len[:, None]) & (pos < P + resp_len[:, None])).long()
    response_mask = attention[:, P:].clone()
    tensors = {
        "prompts": torch.zeros(B, P, dtype=torch.long), "responses": torch.zeros(B, R, dtype=torch.long),
        "input_ids": torch.zeros(B, P + R, dtype=torch.long), "attention_mask": attention,
        "response_mask": response_mask,
        "token_level_scores": torch.randn(B, R, generator=gen) * response_mask,
        "token_level_rewards": torch.randn(B, R, generator=gen) * response_mask,
        "advantages": torch.randn(B, R, generator=gen), "returns": torch.randn(B, R, generator=gen),
    }
    if use_critic:
        tensors["values"] = tensors["returns"] + 0.3 * torch.randn(B, R, generator=gen)
    return tensors


@pytest.mark.parametrize("use_critic", [False, True])
def test_data_metrics_match_verl(use_critic):
    tensors = _metric_batch(6, use_critic)
    want = compute_data_metrics(DataProto.from_dict(tensors=dict(tensors)), use_critic=use_critic)
    got = data_metrics(Batch(tensors), max_response_length=R, use_critic=use_critic)
    assert set(want) == set(got)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_clip_cov_and_kl_cov_are_not_offered():
    """They select tokens by a covariance over whatever micro-batch they see (clip_cov at random), so
    their loss depends on the micro-batch cut; Ballast's losses are exact shares of the mini-batch loss."""
    assert {"clip_cov", "kl_cov"} & set(POLICY_LOSSES) == set()
    assert {"vanilla", "gspo", "gpg", "geo_mean"} <= set(POLICY_LOSSES)


def test_rollout_probability_metrics_match_verl():
    from verl.utils.debug.metrics import calculate_debug_metrics

    from ballast.trainer.step.metrics import rollout_probs_diff_metrics

    tensors = _metric_batch(7, use_critic=False)
    gen = torch.Generator().manual_seed(8)
    tensors["old_log_probs"] = -torch.rand(B, R, generator=gen) * 3
    tensors["rollout_log_probs"] = tensors["old_log_probs"] + 0.05 * torch.randn(B, R, generator=gen)
    want = calculate_debug_metrics(DataProto.from_dict(tensors=dict(tensors)))
    got = rollout_probs_diff_metrics(Batch(tensors))
    for key, value in want.items():
        if key != "training/rollout_probs_diff_valid":
            assert got[key] == pytest.approx(value, abs=1e-6), key


def test_validation_metrics_at_n_match_verl():
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    from ballast.trainer.step.val_metrics import validation_metrics

    rng = np.random.default_rng(9)
    n, prompts = 5, 4
    sources = ["gsm8k"] * (n * 2) + ["math"] * (n * 2)
    uids = [f"u{i // n}" for i in range(n * prompts)]
    infos = {"reward": rng.integers(0, 2, n * prompts).astype(float).tolist(),
             "acc": rng.random(n * prompts).tolist(),
             "pred": [str(v) for v in rng.integers(0, 3, n * prompts)]}
    got = validation_metrics(sources, uids, infos)
    want = {}
    for source, by_var in process_validation_metrics(sources, uids, infos).items():
        core = "acc" if "acc" in by_var else "reward"
        for var, by_name in by_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in by_name)
            for name, value in by_name.items():  # verl's RayPPOTrainer._val_metrics_update naming
                core_metric = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                want[f"{'val-core' if core_metric else 'val-aux'}/{source}/{var}/{name}"] = value
    assert set(got) == set(want)
    assert "val-core/gsm8k/acc/maj@5/mean" in got and "val-aux/math/reward/best@4/std" in got
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
