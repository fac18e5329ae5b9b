"""Every rollout setting with every other, end to end: a pairwise covering array over {full, LoRA} x
{single-turn, tool agent} x {sync, colocated one batch ahead, separate_async with partial rollouts} x
{rollout TP 1, 2} x {GRPO, PPO} on the tiny model. Every row trains (two steps; three where the batch
generated ahead needs a third for the weights of an update to reach the rollout), its weight-sync
check passes at every check it logs, every metric it logs is finite, and what its levels switch on is
seen working: an adapter-only sync or the merged export (LoRA), answered tool calls (the tool-calling
tiny model), staleness one update old (one batch ahead), weights loaded mid-call (partial rollouts), a
vLLM engine whose TP group is both rollout workers (TP 2), the critic trained (PPO).

Rows also carry the checks of the runs they replace (`_ROW_CHECKS`): GAE credit over tool turns with
verl's separate old-log-prob pass and the tool-agent metrics (row 0), LoRA GRPO with a KL loss against
the adapter-off reference served by vLLM (row 1), partial rollouts under a LoRA adapter merged into
the exported weights (row 2), one batch ahead resuming exactly (row 4), PPO with adapters on actor and
critic, merged sync and rollout correction's bypass mode (row 5). The array itself is checked by a
pure test: every pair of levels of two factors is in some row."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import ray

from testkit.agent import build_tool_calling_model
from testkit.e2e import SPLIT_POOLS, STEP_METRICS, assert_finite

FACTORS = {
    "weights": ("full", "lora"),
    "agent": ("single_turn", "tool_agent"),
    "mode": ("sync", "colocate_async_k1", "separate_async_partial"),
    "rollout_tp": (1, 2),
    "algorithm": ("grpo", "ppo"),
}


class Row(NamedTuple):
    weights: str
    agent: str
    mode: str
    rollout_tp: int
    algorithm: str


# Each mode takes a row and its complement on the four binary factors, and the three rows at TP 1
# (0101, 1100, 0000 over weights/agent/rollout_tp/algorithm) differ pairwise in the way that makes
# every binary pair appear both equal and unequal: 6 rows, the fewest a ternary factor allows.
ROWS = (
    Row("full", "tool_agent", "sync", 1, "ppo"),
    Row("lora", "single_turn", "sync", 2, "grpo"),
    Row("lora", "tool_agent", "separate_async_partial", 1, "grpo"),
    Row("full", "single_turn", "separate_async_partial", 2, "ppo"),
    Row("full", "single_turn", "colocate_async_k1", 1, "grpo"),
    Row("lora", "tool_agent", "colocate_async_k1", 2, "ppo"),
)

OFF = "training/off_policy"
SYNC = "rollout/sync_check"
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=2e-2"]


def test_the_rows_cover_every_pair_of_levels():
    names = list(FACTORS)
    for row in ROWS:
        assert all(getattr(row, n) in FACTORS[n] for n in names), row
    missing = [(a, la, b, lb) for a, b in itertools.combinations(names, 2)
               for la in FACTORS[a] for lb in FACTORS[b]
               if not any(getattr(r, a) == la and getattr(r, b) == lb for r in ROWS)]
    assert not missing, missing


# ---------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    """The tool-calling tiny model at margin 30 (every turn a call: GAE's per-turn credit), and for the
    LoRA rows at margin 9 with the other tokens' rows of its output head taken from the tiny model's
    (x3): a call about 75% of the time, so GRPO groups differ (their advantages, and the update, are
    not 0), and an adapter (which leaves the head alone) moves the log-probs of the weight-sync probe
    measurably; with only the call's and the stop token's rows it barely moves them (~3e-7, the size
    of the engines' rounding)."""
    root = tmp_path_factory.mktemp("tool_models")
    return {30: build_tool_calling_model(root / "margin30"), 9: _live_head(build_tool_calling_model(root / "margin9", margin=9))}


def _live_head(path: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from ballast.models import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    with torch.no_grad():
        rows = original.get_output_embeddings().weight
        head = model.lm_head.weight
        keep = head[rows.shape[0]:].clone(), head[model.config.eos_token_id].clone()
        head[: rows.shape[0]] = 3.0 * rows
        head[rows.shape[0]:], head[model.config.eos_token_id] = keep  # the call's row and the stop token's
    model.save_pretrained(path)
    return path


def _tools_yaml(tmp_path, slow: bool) -> Path:
    path = tmp_path / "tools.yaml"
    calc = ("  - class_name: testkit.agent.SlowCalculatorTool\n    config: {type: native, timeout_s: 10, delay_s: 1}\n"
            if slow else "  - class_name: calculator\n    config: {type: native, timeout_s: 5}\n")
    path.write_text("tools:\n" + calc + "  - class_name: python\n    config: {type: native, timeout_s: 5}\n")
    return path


def _steps(row: Row) -> int:
    # one batch ahead: the batches of steps 1 and 2 both come from the start weights; the third is the
    # first generated after an update, so the first a full-weight check can see
    return 3 if row.mode == "colocate_async_k1" else 2


def row_overrides(row: Row, tool_models, tmp_path) -> list[str]:
    """The overrides a row's levels stand for (on top of testkit.e2e.overrides)."""
    out = ["actor_rollout_ref.rollout.weight_sync_check=True", f"trainer.total_training_steps={_steps(row)}"]
    if row.weights == "lora":
        out += LORA
    if row.agent == "tool_agent":
        margin = 9 if row.weights == "lora" else 30
        out += [f"actor_rollout_ref.model.path={tool_models[margin]}", "actor_rollout_ref.rollout.multi_turn.enable=True",
                "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={_tools_yaml(tmp_path, row.mode.startswith('sep'))}",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"]
    if row.mode == "colocate_async_k1":
        out += ["trainer.ballast_overlap.batches_ahead=1"]
    elif row.mode == "separate_async_partial":
        out += [*SPLIT_POOLS, "trainer.v1.separate_async.num_warmup_batches=1"]
    if row.rollout_tp == 2:
        out += ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
        if row.mode == "separate_async_partial":
            out += ["actor_rollout_ref.rollout.n_gpus_per_node=2"]
    if row.algorithm == "ppo":
        out += ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]
    return out


def _rows_logged(path) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _engine_tp_ranks(group) -> list:
    """Each worker's vLLM TP group, as the engine itself reports it."""
    return ray.get([w.__ray_call__.remote(lambda self: self.rollout.tp_group_ranks) for w in group.workers])


def _check_levels(row: Row, trainer, rows: list[dict], out: str) -> None:
    """What every row's levels switch on, seen in the run (module docstring)."""
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == list(range(1, _steps(row) + 1))
    bad = {(r["step"], k): v for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, bad
    checked = [r for r in rows if f"{SYNC}/mean_abs_diff" in r]
    assert checked, "no weight-sync check logged"
    assert all(r[f"{SYNC}/mean_abs_diff"] <= r[f"{SYNC}/tolerance"] for r in checked), checked
    split = row.mode == "separate_async_partial"
    if row.weights == "lora":
        assert ("(merged with the LoRA adapter)" if split else "LoRA weight sync: ") in out
        if not split:
            assert checked[-1][f"{SYNC}/adapter_effect"] > 0  # the last check: an adapter the update moved
    if row.agent == "tool_agent":
        assert sum(r["agent/tool_calls/total"] for r in rows if "agent/tool_calls/total" in r) > 0
        assert all(r.get("agent/tool_errors/total", 0.0) == 0.0 for r in rows)
    if row.mode == "colocate_async_k1":
        assert trainer.overlap.batches_ahead == 1 and trainer.correction.bypass
        assert [r[f"{OFF}/trajectory_staleness/max"] for r in rows if "actor/pg_loss" in r] == [0.0, 1.0, 1.0]
    if split:
        assert trainer.overlap.partial_rollout and trainer.workers.rollout is not None
        loads = [r for r in rows if r.get("rollout/partial/weight_loads", 0) >= 1]
        assert loads, [(r["step"], r.get("rollout/partial/weight_loads")) for r in rows]
        for r in loads:  # the weights loaded mid-call are the trainer's, and a call's tokens span two versions
            assert r[f"{SYNC}/mean_abs_diff"] < 1e-5 and r[f"{OFF}/trajectory_spans/max"] == 2
    if row.rollout_tp == 2:
        assert trainer.sizes.rollout_tp == 2 and trainer.sizes.rollout_dp == 1
        assert _engine_tp_ranks(trainer.workers.generator) == [[0, 1], [0, 1]]
    if row.algorithm == "ppo":
        for r in (r for r in rows if "actor/pg_loss" in r):
            assert_finite(r, ["critic/vf_loss", "critic/values/mean", "critic/returns/mean", "critic/grad_norm"])
            assert r["critic/grad_norm"] > 0


class Run(NamedTuple):
    """What a row's own checks see after its run."""

    final: dict
    rows: list
    seen: object
    out: str
    path: Path
    overrides: list
    session: object


def _dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _steps_only(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


# Row 0: PPO/GAE on tool conversations with verl's separate old-log-prob pass, the tool-agent metrics
# (validation too), extra_info as the reward function sees it, and rollout correction on the rollout's
# log-probs.
AGENT_METRICS = ["agent/num_turns/mean", "agent/num_turns/max", "agent/tool_calls/total", "agent/tool_errors/total",
                 "agent/tool_timeouts/total", "agent/tool_latency_s/mean", "agent/stop_reason/answer",
                 "agent/stop_reason/length", "response_length/model_tokens/mean", "response_length/tool_tokens/mean",
                 "agent/tokenization_mismatch/frac"]
RC_METRICS = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean",
              "rollout_corr/rollout_rs_masked_fraction", "training/rollout_actor_log_prob_diff/max"]
PPO_TOOLS = [
    "actor_rollout_ref.actor.use_dynamic_bsz=False", "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.actor.old_log_prob_from_update=False", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    # whole replicas (the CPU configs' setting): actor and critic train under DDP, the reference is a
    # frozen plain module; the other runs shard with FSDP2
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "critic.fsdp_config.fsdp_size=1",
    "trainer.test_freq=2", "actor_rollout_ref.rollout.agent.max_concurrent_conversations=4",
    "+algorithm/rollout_correction=decoupled_token_is", "algorithm.rollout_correction.rollout_rs=seq_max_k3",
    "algorithm.rollout_correction.rollout_rs_threshold=5.0",
    # asserts what extra_info holds (training and validation) and returns what it saw
    f"custom_reward_function.path={Path(__file__).with_name('agent_extra_info_reward.py')}",
]


def _ppo_tools_before(trainer):
    assert trainer.old_log_probs.mode == "pass"
    trained = []  # the batch of each critic update: what the driver computed for the step
    update_critic = trainer.workers.critic.update_critic
    trainer.workers.critic.update_critic = lambda batch, plan: trained.append(batch) or update_critic(batch, plan)
    return trained


def _ppo_tools_after(run: Run):
    m = run.final
    assert_finite(m, [k for k in STEP_METRICS if k != "perf/num_micro_batches"] + [
        "critic/vf_loss", "critic/vf_clipfrac", "actor/kl_loss", "timing_s/values", "timing_s/ref",
        "timing_s/update_critic", "perf/mfu/actor_infer", *AGENT_METRICS, *RC_METRICS])
    assert len(run.seen) == 2 and m["agent/tool_calls/total"] > 0
    for batch in run.seen:
        _assert_every_turn_is_credited_with_the_score(batch)
    assert m["reward_extra/seen_num_turns/mean"] == pytest.approx(m["agent/num_turns/mean"])
    assert m["reward_extra/seen_tool_calls/mean"] == pytest.approx(m["agent/tool_calls/mean"])
    missing = [k for k in ("val/" + k for k in AGENT_METRICS) if k not in m]
    assert not missing, missing
    reasons = sum(m[f"agent/stop_reason/{r}"] for r in ("answer", "length", "max_assistant_turns", "max_user_turns"))
    assert reasons == pytest.approx(1.0)
    assert m["agent/tokenization_mismatch/frac"] == 0.0
    # the old log-probs of verl's pass and the rollout's agree as the engines do: nothing to correct
    assert m["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and m["rollout_corr/kl"] < 1e-4


def _assert_every_turn_is_credited_with_the_score(batch):
    """GAE over [turn | tool response (mask 0) | turn]: with gamma = lam = 1 (verl's defaults) every
    sampled token's return is its conversation's score (the values telescope), the first turn's too (a
    tool response is no episode end), and the advantages are the whitened returns minus values."""
    import torch

    from ballast.trainer.algorithms import masked_whiten

    mask = batch["response_mask"].bool()
    assert (mask[:, 1:] & ~mask[:, :-1]).any(dim=1).all()  # every response has a turn after a tool response
    first_turn = mask.long().cumprod(dim=1).bool()
    score = batch["token_level_rewards"].sum(dim=1, keepdim=True).expand_as(mask)
    assert (score[:, 0] > 0).all()  # the repeat task's partial credit: the next check is not 0 == 0
    torch.testing.assert_close(batch["returns"][mask], score[mask])
    expected = masked_whiten((batch["returns"] - batch["values"]) * mask, mask)
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-4, atol=1e-5)
    assert (batch["advantages"][first_turn] != 0).all()


# Row 1: LoRA GRPO with a KL loss, the reference being the actor with its adapter off (no second
# model); vLLM serves each adapter version (every request of the agent loop names it); checkpoints
# hold the adapter only.
LORA_KL = ["actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.actor.use_kl_loss=True",
           "actor_rollout_ref.actor.kl_loss_coef=0.1", "trainer.save_freq=2"]


def _lora_kl_before(trainer):
    assert trainer.sizes.use_reference
    roles = ray.get([w.__ray_call__.remote(lambda self: (self.ref is None, self.actor.adapter is not None))
                     for w in trainer.workers.actor_rollout.workers])
    assert roles == [(True, True)] * 2  # the reference is the actor's own base weights


def _lora_kl_after(run: Run):
    m = run.final
    assert "LoRA weight sync: adapter only (rank 8)" in run.out
    assert_finite(m, [f"{SYNC}/mean_abs_diff", f"{SYNC}/adapter_effect", "actor/kl_loss", "timing_s/update_weights",
                      "training/rollout_actor_log_prob_diff/max"])
    # step 2 samples with the adapter of the first update: vLLM serves exactly it
    assert m[f"{SYNC}/mean_abs_diff"] < 1e-4
    assert m[f"{SYNC}/adapter_effect"] > 1e-3  # the check could have told base from adapter
    assert m["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert m["actor/kl_loss"] > 0  # the reference (adapter off) differs from the trained actor
    ckpt = _dir_bytes(run.path / "global_step_2" / "actor")
    assert 0 < ckpt < _model_bytes() / 2, "a LoRA checkpoint holds the adapter, not the base weights"


def _model_bytes() -> int:
    from ballast.models import tiny_model_dir

    return _dir_bytes(tiny_model_dir())


# Row 2: partial rollouts under a LoRA adapter, merged into the exported weights: the trainer's update
# lands while the conversations wait on a slow tool (1 s), the rollout worker loads it mid-call and
# the conversations go on under it; every token carries the version that sampled it.
def _partial_after(run: Run):
    assert "partial rollouts: new weights interrupt the generations in flight" in run.out
    for r in _steps_only(run.rows):
        assert r[f"{OFF}/trajectory_staleness_worst/max"] <= 1, r  # every token within the bound
        assert r[f"{OFF}/trajectory_staleness/min"] >= 0
        assert r[f"{OFF}/trajectory_spans/max"] <= 2  # one update per step: a call sees at most one switch
        assert math.isfinite(r["rollout_corr/k3_kl"])
        if r.get("rollout/partial/weight_loads", 0) >= 1:
            assert r[f"{OFF}/trajectory_staleness/min"] == 0  # their freshest tokens: the policy being trained


def _bypass_before(trainer):
    assert trainer.correction.bypass  # stale tokens: corrected by default


# Row 3: single-turn conversations two at a time, so that step 2's generation outlasts step 1's update.
SLOW_SINGLE_TURN = ["actor_rollout_ref.rollout.agent.max_concurrent_conversations=4"]

# Row 4: one batch ahead, colocated: every batch after the first trained on weights one update old,
# corrected for, and a resume from a checkpoint continues exactly like the uninterrupted run.
AHEAD = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.save_freq=2"]
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "response_length/mean",
            "rollout_corr/k3_kl", f"{OFF}/trajectory_staleness/max"]


def _deterministic(row):
    """A metrics row without what depends on the machine's speed."""
    return {k: v for k, v in row.items() if not k.startswith(("timing", "perf/", "timestamp"))}


def _ahead_after(run: Run):
    rows = _steps_only(run.rows)
    assert rows[0]["rollout_corr/k3_kl"] < 1e-6 < min(r["rollout_corr/k3_kl"] for r in rows[1:])  # stale from step 2
    assert all(0.0 <= r["perf/trainer_idle_ratio"] <= 1.0 for r in rows)
    checkpoint = run.path / "global_step_2"
    assert (checkpoint / "rollouts_ahead" / "tree.json").is_file()  # step 3's batch, on step 1's weights
    with run.session("resumed", *run.overrides, "trainer.resume_mode=resume_path",
                     f"trainer.resume_from_path={checkpoint}") as trainer:
        assert trainer.global_step == 2
        trainer.fit()
    resumed = {r["step"]: r for r in _rows_logged(run.path.parent / "resumed")}
    assert sorted(resumed) == [3]
    again = resumed[3]
    assert set(COMPARED) <= set(again)
    for key, value in _deterministic(rows[2]).items():
        assert again[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


# Row 5: PPO with an adapter on the actor and one on the critic (which also trains its fresh value
# head whole); the actor's adapter reaches the rollout merged into the weights; rollout correction's
# bypass mode takes the rollout's log-probs as the old policy while the KL loss's reference is the
# actor with its adapter off.
LORA_PPO = ["critic.model.lora_rank=4", "actor_rollout_ref.model.lora.merge=True",
            "actor_rollout_ref.rollout.calculate_log_probs=True", "+algorithm/rollout_correction=bypass_ppo_clip",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.save_freq=2"]


def _lora_ppo_before(trainer):
    assert trainer.old_log_probs.mode == "rollout"
    passes = []
    original = trainer.workers.actor_rollout.compute_log_prob
    trainer.workers.actor_rollout.compute_log_prob = lambda *a, **k: passes.append(1) or original(*a, **k)
    return passes


def _lora_ppo_after(run: Run):
    m, first = run.final, _steps_only(run.rows)[0]
    assert run.seen == []  # the rollout's log-probs are the old policy
    assert "LoRA weight sync: merged weights" in run.out
    assert_finite(m, ["critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "rollout_corr/k3_kl"])
    assert m[f"{SYNC}/mean_abs_diff"] < 1e-4 < m[f"{SYNC}/adapter_effect"]
    # step 1, one mini-batch: every row is trained by the policy that sampled it, so the rollout's
    # log-probs and the update's agree as exactly as the engines do, and the correction's KL is ~0
    assert first["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert abs(first["rollout_corr/kl"]) < 1e-4
    assert m["actor/kl_loss"] > 0  # an adapter the updates moved against the base (adapter off)
    critic_ckpt = _dir_bytes(run.path / "global_step_2" / "critic")
    assert 0 < critic_ckpt < _model_bytes() / 2


# row index -> (extra overrides, before(trainer) -> seen, after(Run))
ROW_CHECKS = {
    0: (PPO_TOOLS, _ppo_tools_before, _ppo_tools_after),
    1: (LORA_KL, _lora_kl_before, _lora_kl_after),
    2: ((), _bypass_before, _partial_after),
    3: (SLOW_SINGLE_TURN, _bypass_before, None),
    4: (AHEAD, _bypass_before, _ahead_after),
    5: (LORA_PPO, _lora_ppo_before, _lora_ppo_after),
}


@pytest.mark.parametrize("index", range(len(ROWS)), ids=[
    f"{i}-{r.weights}-{r.agent}-{r.mode}-tp{r.rollout_tp}-{r.algorithm}" for i, r in enumerate(ROWS)])
def test_row(index, session, tool_models, tmp_path, capfd):
    row = ROWS[index]
    if row.rollout_tp == 2:
        pytest.importorskip("vllm")
    extra, before, after = ROW_CHECKS[index]
    overrides = [*row_overrides(row, tool_models, tmp_path), *extra]
    with session("run", *overrides) as trainer:
        seen = before(trainer) if before else None
        final = trainer.fit()
        captured = capfd.readouterr()
        out = captured.out + captured.err
        rows = _rows_logged(tmp_path / "run")
        _check_levels(row, trainer, rows, out)
    if after:
        after(Run(final, rows, seen, out, tmp_path / "run", overrides, session))
