"""Partial rollouts on split pools (separate_async, one batch ahead: on by default, as verl's): the
trainer's update lands while the rollout pool's conversations are in flight (each waits 1 s between
its turns, like a slow tool), the rollout workers load the new weights from the mailbox mid-call and
the conversations go on under them; every token carries the version that sampled it, so no sample is
staler than the bound, spans show the switches, and the weight-sync check passes after every load.
The actor trains a LoRA adapter, which crosses to the rollout pool merged into the weights (the route
and the mid-call loads are those of full fine-tuning). A rollout pool that fails to start is cleaned
up: the next session in the process starts."""

import json
import math
import os

import pytest

from ballast.single_controller.errors import WorkerError
from testkit.e2e import SPLIT_POOLS

OFF = "training/off_policy"


def test_updates_land_mid_generation_and_every_token_knows_its_version(session, tmp_path, capfd, monkeypatch):
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: waiting\n  _target_: testkit.agent.WaitingLoop\n")
    # partial rollouts are on by default with separate_async and a window (verl's meaning)
    extra = [*SPLIT_POOLS, "trainer.v1.separate_async.num_warmup_batches=1", "actor_rollout_ref.rollout.mode=async",
             f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
             "actor_rollout_ref.rollout.agent.default_agent_loop=waiting", "data.max_response_length=32",
             "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=False",
             "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
             "actor_rollout_ref.actor.optim.lr=2e-2"]
    # first a start that fails in the rollout pool: a loop module the driver can import (it checks the
    # config at start-up) but the workers cannot. The error names it, and the failed start leaves
    # nothing behind (placement groups, actors) that would refuse the next session in the process.
    (tmp_path / "driver_only_loops.py").write_text("from testkit.agent import WaitingLoop as Loop\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = tmp_path / "broken.yaml"
    broken.write_text("- name: waiting\n  _target_: driver_only_loops.Loop\n")
    with pytest.raises(WorkerError, match="cannot import module 'driver_only_loops'"):
        with session("broken", *extra, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={broken}"):
            pass
    with session("partial", *extra) as trainer:
        assert trainer.correction.bypass  # stale tokens: corrected by default
        trainer.fit()
    out = capfd.readouterr().out
    assert "partial rollouts: new weights interrupt the generations in flight" in out
    assert "(merged with the LoRA adapter)" in out
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "partial", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r[f"{OFF}/trajectory_staleness_worst/max"] <= 1, r  # every token within the bound
        assert r[f"{OFF}/trajectory_staleness/min"] >= 0
        assert r[f"{OFF}/trajectory_spans/max"] <= 2  # one update per step: a call sees at most one switch
        assert math.isfinite(r["rollout_corr/k3_kl"])
    # steps 2-3 were generated while the previous update ran (about 2 s of conversation against a
    # tiny-model update of ~0.2-0.4 s): the new weights reached them mid-call
    switched = [r for r in rows[1:] if r[f"{OFF}/trajectory_spans/max"] == 2]
    assert switched, [(r["step"], r[f"{OFF}/trajectory_spans/max"]) for r in rows]
    for r in switched:
        assert r["rollout/partial/weight_loads"] >= 1
        assert r["rollout/sync_check/mean_abs_diff"] < 1e-5  # the weights loaded mid-call are the trainer's
        assert r[f"{OFF}/trajectory_staleness/min"] == 0  # their freshest tokens: the policy being trained
