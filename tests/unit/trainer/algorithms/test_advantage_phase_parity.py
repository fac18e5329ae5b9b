"""The driver's way from scores to advantages against verl 0.9.1's fit loop, to 1e-6: verl's
`apply_kl_penalty`, then `compute_rollout_correction_and_add_to_batch`, then `compute_advantage`, against
Ballast's `rewards_and_advantages` (what `RayPPOTrainer.train_step` runs), with the KL in the reward,
a decoupled correction that rejects one whole row, multi-turn masks and the adaptive KL controller.

Where verl is not installed the whole module is skipped at collection, like the other parity tests.
"""

import ast
import contextlib
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.algorithms import make_kl_controller
from ballast.trainer.config import load_config
from ballast.trainer.step.advantage_phase import rewards_and_advantages
from ballast.trainer.step.rollout_correction import RolloutCorrectionPhase, rollout_correction_settings

V = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.1 is not installed (bash scripts/setup.sh "
                        "installs it): the verl parity tests need it as their reference")
import verl.utils.torch_functional as VF  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch  # noqa: E402



def _verl_trainer_functions(*names):
    """verl's own driver functions, compiled from its installed `verl/trainer/ppo/ray_trainer.py` alone:
    importing that module loads verl's whole worker stack (torchdata and more), which the reference
    install (--no-deps) lacks, while these need only core_algos, masked_mean and DataProto."""
    path = Path(V.__file__).with_name("ray_trainer.py")
    tree = ast.parse(path.read_text())
    nodes = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(node.name for node in nodes) == sorted(names), f"verl's {path} no longer defines {names}"
    namespace = {"core_algos": V, "AdvantageEstimator": V.AdvantageEstimator, "masked_mean": VF.masked_mean,
                 "DataProto": DataProto, "AlgoConfig": AlgoConfig, "Optional": Optional, "np": np, "torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return [namespace[name] for name in names]


# verl's fit loops (the legacy RayPPOTrainer.fit and v1's _compute_advantage) call these in this order
apply_kl_penalty, compute_advantage, _ = _verl_trainer_functions("apply_kl_penalty", "compute_advantage",
                                                                 "compute_response_mask")
TOL = dict(atol=1e-6, rtol=1e-6)
B, R, N = 12, 16, 4
REJECTED = 5
GAMMA, LAM, KL_COEF, TARGET_KL, HORIZON = 0.95, 0.9, 0.2, 0.01, 100
CORRECTION = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")


def _step_batch(seed):
    """A step's tensors after the values phase: two-turn responses (a tool span between the turns),
    right-padded; the outcome score on the last sampled token; rollout log-probs close to the old
    ones except row REJECTED's, which the sequence-level rejection drops."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, R, dtype=torch.float64)
    for row in range(B):
        first, span, second = (int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(3))
        mask[row, :first] = 1.0
        mask[row, first + span:first + span + second] = 1.0
    last = (torch.arange(R) * mask).argmax(dim=1)
    scores = torch.zeros(B, R, dtype=torch.float64)
    scores[torch.arange(B), last] = torch.rand(B, generator=gen, dtype=torch.float64)
    old = -torch.rand(B, R, generator=gen, dtype=torch.float64) * 2
    ref = old + 0.3 * torch.randn(B, R, generator=gen, dtype=torch.float64)
    rollout = old + 0.05 * torch.randn(B, R, generator=gen, dtype=torch.float64)
    rollout[REJECTED] = old[REJECTED] + 2.5
    values = torch.randn(B, R, generator=gen, dtype=torch.float64)
    tensors = {"response_mask": mask, "token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref,
               "rollout_log_probs": rollout * mask, "values": values}
    uids = np.array([f"p{i // N}" for i in range(B)], dtype=object)
    return tensors, uids


def _verl(tensors, uids, estimator):
    data = DataProto.from_dict(tensors={k: v.clone() for k, v in tensors.items()}, non_tensors={"uid": uids.copy()})
    kl_ctrl = V.AdaptiveKLController(init_kl_coef=KL_COEF, target_kl=TARGET_KL, horizon=HORIZON)
    data, metrics = apply_kl_penalty(data, kl_ctrl=kl_ctrl, kl_penalty="low_var_kl")
    data, corr_metrics = compute_rollout_correction_and_add_to_batch(data, RolloutCorrectionConfig(**CORRECTION))
    metrics.update(corr_metrics)
    data = compute_advantage(data, adv_estimator=estimator, gamma=GAMMA, lam=LAM, num_repeat=N,
                             norm_adv_by_std_in_grpo=True, config=AlgoConfig(gamma=GAMMA, lam=LAM))
    return data.batch, metrics, kl_ctrl.value


def _ours(tensors, uids, estimator):
    rc = "algorithm.rollout_correction"
    cfg = load_config(["data.train_files=x", "actor_rollout_ref.model.path=m",
                       "actor_rollout_ref.rollout.calculate_log_probs=True", f"algorithm.adv_estimator={estimator}",
                       "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=low_var_kl",
                       f"algorithm.gamma={GAMMA}", f"algorithm.lam={LAM}", "algorithm.kl_ctrl.type=adaptive",
                       f"algorithm.kl_ctrl.kl_coef={KL_COEF}", f"algorithm.kl_ctrl.target_kl={TARGET_KL}",
                       f"algorithm.kl_ctrl.horizon={HORIZON}", *(f"{rc}.{k}={v}" for k, v in CORRECTION.items())])
    kl = cfg.algorithm.kl_ctrl
    kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
    batch = Batch({k: v.clone() for k, v in tensors.items()}, {"uid": uids.copy()})
    timed = []
    metrics = rewards_and_advantages(batch, cfg.algorithm, kl_ctrl, RolloutCorrectionPhase(rollout_correction_settings(cfg)),
                                     lambda name: timed.append(name) or contextlib.nullcontext())
    assert set(timed) == {"adv", "rollout_corr"}  # the step's timing_s/adv and timing_s/rollout_corr
    return batch, metrics, kl_ctrl.value


@pytest.mark.parametrize("estimator, seed", [("gae", 0), ("grpo", 1), ("reinforce_plus_plus", 2), ("rloo", 3)])
def test_kl_in_reward_then_rejection_then_advantages_match_verls_fit_loop(estimator, seed):
    tensors, uids = _step_batch(seed)
    want, want_metrics, want_coef = _verl(tensors, uids, estimator)
    got, got_metrics, got_coef = _ours(tensors, uids, estimator)
    before, mask = tensors["response_mask"], want["response_mask"].double()
    # exactly one row is rejected, whole: the case where the order of KL and rejection matters
    assert torch.equal((mask.sum(1) == 0) & (before.sum(1) > 0), torch.arange(B) == REJECTED)
    torch.testing.assert_close(got["response_mask"].double(), mask, **TOL)
    # the rejected row pays its KL penalty in the reward: its score - beta * KL enters its group's statistics
    torch.testing.assert_close(got["token_level_rewards"], want["token_level_rewards"], **TOL)
    assert (got["token_level_rewards"][REJECTED] != tensors["token_level_scores"][REJECTED]).any()
    torch.testing.assert_close(got["rollout_is_weights"].double() * mask, want["rollout_is_weights"] * mask, **TOL)
    for key in ("advantages", "returns"):
        torch.testing.assert_close(got[key] * mask, want[key] * mask, **TOL)
    assert torch.all(got["advantages"][REJECTED] == 0)
    assert got_coef == pytest.approx(want_coef, rel=1e-12)  # the controller saw the same KL
    assert set(want_metrics) <= set(got_metrics)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
