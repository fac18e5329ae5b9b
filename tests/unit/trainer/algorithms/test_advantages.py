"""Advantage estimators and KL pieces against independent closed-form computations."""

import numpy as np
import pytest
import torch

from ballast.trainer.algorithms import get_adv_estimator, kl_penalty, make_kl_controller, masked_whiten
from ballast.trainer.algorithms.advantages import discounted_returns


def _outcome_batch(seed=0, groups=4, n=5, length=7):
    g = torch.Generator().manual_seed(seed)
    batch = groups * n
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    scores = torch.rand(batch, generator=g)
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = scores  # outcome reward on the last response token
    index = np.array([f"uid-{i // n}" for i in range(batch)], dtype=object)
    return rewards, mask, index, scores


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_normalises_within_each_prompt_group(norm_by_std):
    rewards, mask, index, scores = _outcome_batch()
    adv, returns = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=index,
                                             norm_adv_by_std_in_grpo=norm_by_std)
    assert torch.equal(adv, returns)
    assert torch.all(adv[mask == 0] == 0)
    per_sample = adv.max(dim=1).values.where(adv.max(dim=1).values != 0, adv.min(dim=1).values)
    for g in range(4):
        group = slice(g * 5, (g + 1) * 5)
        s = scores[group]
        expected = s - s.mean()
        if norm_by_std:
            expected = expected / (s.std() + 1e-6)
        torch.testing.assert_close(per_sample[group], expected, rtol=1e-5, atol=1e-6)
        # every token of a sample carries the sample's advantage
        for i in range(g * 5, (g + 1) * 5):
            real = adv[i][mask[i] == 1]
            assert torch.allclose(real, real[0].expand_as(real))


def test_grpo_is_permutation_equivariant_and_a_single_sample_group_keeps_its_score():
    rewards, mask, index, _ = _outcome_batch(seed=3)
    fn = get_adv_estimator("grpo")
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index)
    perm = torch.randperm(len(index), generator=torch.Generator().manual_seed(1))
    adv_p, _ = fn(token_level_rewards=rewards[perm], response_mask=mask[perm], index=index[perm.numpy()])
    torch.testing.assert_close(adv_p, adv[perm])
    lonely, _ = fn(token_level_rewards=rewards[:1], response_mask=mask[:1], index=index[:1])
    torch.testing.assert_close(lonely, rewards[:1].sum(-1, keepdim=True) * mask[:1] / (1 + 1e-6))


def test_rloo_is_score_minus_mean_of_the_others():
    rewards, mask, index, scores = _outcome_batch(seed=5)
    adv, _ = get_adv_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=index)
    for i in range(len(index)):
        peers = [j for j in range(len(index)) if index[j] == index[i] and j != i]
        expected = scores[i] - scores[peers].mean()
        real = adv[i][mask[i] == 1]
        torch.testing.assert_close(real, expected.expand_as(real), rtol=1e-5, atol=1e-6)


def test_discounted_returns_match_explicit_sums():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    gamma = 0.9
    returns = discounted_returns(rewards * mask, mask, gamma)
    for b in range(3):
        n = int(mask[b].sum())
        for t in range(n):
            expected = sum(gamma ** (k - t) * rewards[b, k] for k in range(t, n))
            torch.testing.assert_close(returns[b, t], torch.as_tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-5)
        assert torch.all(returns[b, n:] == 0)


def test_gae_matches_the_delta_sum_definition():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    lengths = torch.tensor([8, 5, 3, 1])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    gamma, lam = 0.95, 0.8
    adv, returns = get_adv_estimator("gae")(token_level_rewards=rewards * mask, response_mask=mask, values=values,
                                            gamma=gamma, lam=lam)
    raw = torch.zeros_like(values)
    for b in range(4):
        n = int(lengths[b])
        v = list(values[b, :n]) + [torch.tensor(0.0)]  # terminal after the last response token
        deltas = [rewards[b, t] + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            raw[b, t] = sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n))
    torch.testing.assert_close(returns, (raw + values) * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv, masked_whiten(raw, mask), rtol=1e-4, atol=1e-5)
    assert abs(float((adv * mask).sum() / mask.sum())) < 1e-5


def _multi_turn_batch(seed=11, groups=3, n=4, width=20):
    """Responses of up to three sampled turns with mask-0 spans (tool tokens) between them, right-padded;
    the outcome reward on each row's last sampled token; values (and rewards) inside the spans are noise.
    Also the same rows compacted: the sampled tokens moved left, in order, spans cut out."""
    g = torch.Generator().manual_seed(seed)
    batch = groups * n
    mask = torch.zeros(batch, width)
    compact = torch.zeros(batch, width)
    for row in range(batch):
        col = kept = 0
        for turn in range(int(torch.randint(1, 4, (1,), generator=g))):
            if turn:
                col += int(torch.randint(1, 4, (1,), generator=g))  # the tool response between the turns
            tokens = int(torch.randint(1, 4, (1,), generator=g))
            mask[row, col:col + tokens] = 1.0
            col, kept = col + tokens, kept + tokens
        compact[row, :kept] = 1.0
    rewards = torch.zeros(batch, width, dtype=torch.float64)
    last = (torch.arange(width) * mask).argmax(dim=1)
    rewards[torch.arange(batch), last] = torch.rand(batch, generator=g, dtype=torch.float64) + 0.5
    values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    index = np.array([f"uid-{i // n}" for i in range(batch)], dtype=object)
    return rewards, values, mask.double(), compact.double(), index


def _compacted(x, mask, compact):
    out = torch.zeros_like(x)
    out[compact.bool()] = x[mask.bool()]  # row-major: each row's kept tokens, in order
    return out


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "grpo", "rloo", "reinforce_plus_plus_baseline",
                                  "grpo_passk", "opo", "gpg"])
def test_mask_zero_spans_inside_a_response_change_nothing(name):
    """A response with tool tokens between its turns is trained like the same response with them cut
    out: no reward, discount step or value is read at a mask-0 position, and the accumulators cross it
    (the first zero does not end the episode)."""
    rewards, values, mask, compact, index = _multi_turn_batch()
    assert ((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any()  # some rows really have interior spans
    fn = get_adv_estimator(name)
    kwargs = dict(index=index, gamma=0.9, lam=0.8)
    adv, returns = fn(token_level_rewards=rewards, response_mask=mask, values=values, **kwargs)
    want_adv, want_returns = fn(token_level_rewards=_compacted(rewards, mask, compact), response_mask=compact,
                                values=_compacted(values, mask, compact), **kwargs)
    torch.testing.assert_close(_compacted(adv, mask, compact), want_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(_compacted(returns, mask, compact), want_returns, rtol=1e-9, atol=1e-9)
    assert torch.all(adv[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)


def test_discounted_returns_across_tool_spans_match_explicit_sums():
    """G_t = sum over the row's response tokens k >= t of gamma^(response tokens in [t, k)) r_k."""
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(3, 8, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [1, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1, 1, 1]],
                        dtype=torch.float64)
    gamma = 0.9
    returns = discounted_returns(rewards, mask, gamma)
    for b in range(3):
        kept = [k for k in range(8) if mask[b, k]]
        for i, t in enumerate(kept):
            expected = sum(gamma ** j * rewards[b, k] for j, k in enumerate(kept[i:]))
            assert float(returns[b, t]) == pytest.approx(float(expected), rel=1e-12)
    assert torch.all(returns[mask == 0] == 0)


def test_gae_with_gamma_and_lambda_one_returns_the_final_score_on_every_turn():
    """With gamma = lam = 1 the value terms telescope: every response token's return is the reward that
    follows it, whatever the critic says, so a first turn before a tool response gets the outcome."""
    rewards, values, mask, _, _ = _multi_turn_batch(seed=4)
    _, returns = get_adv_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=values,
                                          gamma=1.0, lam=1.0)
    scores = rewards.sum(dim=1, keepdim=True).expand_as(rewards)
    torch.testing.assert_close(returns[mask == 1], scores[mask == 1], rtol=1e-12, atol=1e-12)


def test_gae_without_values_is_a_clear_error():
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))


def test_reinforce_plus_plus_whitens_returns():
    rewards, mask, index, _ = _outcome_batch(seed=7)
    adv, returns = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask,
                                                            index=index, gamma=1.0)
    real = adv[mask == 1]
    assert abs(float(real.mean())) < 1e-5 and abs(float(real.std()) - 1.0) < 1e-3
    torch.testing.assert_close(returns, discounted_returns(rewards, mask, 1.0))


def test_unknown_estimator_names_the_key():
    with pytest.raises(ValueError, match="algorithm.adv_estimator='nope'"):
        get_adv_estimator("nope")


def test_kl_estimators_properties():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert torch.all(kl_penalty(logp, ref, "low_var_kl") >= 0)
    assert torch.all(kl_penalty(logp, ref, "mse") >= 0)
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), logp - ref)
    assert torch.all(kl_penalty(logp, logp, "low_var_kl") == 0)
    # k1 and k3 are unbiased estimators of KL(p||q) for samples drawn from p
    p = torch.distributions.Categorical(logits=torch.tensor([0.5, 0.1, -0.3]))
    q = torch.distributions.Categorical(logits=torch.tensor([0.1, 0.3, 0.0]))
    x = p.sample((200_000,), )
    true_kl = float(torch.distributions.kl_divergence(p, q))
    for kind in ("kl", "low_var_kl"):
        est = float(kl_penalty(p.log_prob(x), q.log_prob(x), kind).mean())
        assert abs(est - true_kl) < 0.01, (kind, est, true_kl)


def test_adaptive_kl_controller_moves_toward_target():
    ctl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    ctl.update(current_kl=0.5, n_steps=10)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(current_kl=0.0, n_steps=10)
    assert ctl.value < 0.1 * (1 + 0.2 * 10 / 100)
    fixed = make_kl_controller("fixed", kl_coef=0.1, target_kl=0.05, horizon=100)
    fixed.update(1.0, 10)
    assert fixed.value == 0.1
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        make_kl_controller("pid", 0.1, 0.1, 1)
