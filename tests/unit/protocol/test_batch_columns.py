"""The column table (`ballast.protocol.fields`) against the code that writes columns.

Runtime, exact: one tiny step is run through the real writers, in the driver's order, with stand-in
engines (their outputs are zeros; only the columns matter): the data's prompt batch, the rollout's
output builder and the agent loop's columns, the actor's old-log-prob pass and the update's
hand-back, the reference and critic passes, the reward's scores, the advantage phase and both modes
of rollout correction. Every column a writer puts into a Batch (`Batch.__setitem__`, recorded) or
returns (a worker's Batch, a builder's TensorDict) must be a field the table attributes to that
writer, with the table's kind, dtype and shape; and every field the table lists must be written by
exactly the writers it names, so that a column nobody writes any more cannot stay listed.

Static, as a second net for writers this step does not run: an AST scan of the package for the two
literal forms a new column usually takes, `<...>batch["key"] = ...` and `Batch({"key": ...})`.
Columns named through variables (`batch[NORM_KEYS[0]]`, `f"agent_{key}"`) are seen only by the
runtime part. Finally the losses run on exactly the columns the workers hand them (`columns_read_by`):
a loss that reads a column the table does not say it reads fails with a KeyError.
"""

from __future__ import annotations

import ast
import contextlib
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.data.dataset import PromptCollator
from ballast.engine.losses import GlobalNorm
from ballast.protocol import FIELDS, Batch, check_fields
from ballast.protocol import fields as F
from ballast.trainer.algorithms import make_kl_controller
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, CriticLossConfig, critic_loss, make_actor_loss
from ballast.trainer.algorithms.rollout_correction import parse_rollout_correction
from ballast.trainer.ray_trainer import RayPPOTrainer
from ballast.trainer.run.data import collated_to_batch
from ballast.trainer.step.advantage_phase import rewards_and_advantages
from ballast.trainer.step.old_log_probs import run_pass, take_from_update
from ballast.trainer.step.rollout_correction import RolloutCorrectionPhase
from ballast.workers.actor_rollout_ref import ActorRolloutRefWorker, engine_input
from ballast.workers.agent_loop.base import AgentLoopOutput, StopReason
from ballast.workers.agent_loop.output import assemble, sample_columns
from ballast.workers.critic import CriticWorker
from ballast.workers.train_loop import UpdateResult

PKG = Path(__file__).resolve().parents[3] / "ballast"
PAD, RESPONSE_LEN = 0, 4
PROMPTS = [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]  # two prompts, n = 2
RESPONSES = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20]]


class Recorder:
    """Which columns each writer wrote, and a check of every one against the table."""

    def __init__(self) -> None:
        self.by: dict[str, set[str]] = defaultdict(set)
        self.writer: str | None = None

    @contextlib.contextmanager
    def writing(self, writer: str, batch: Batch):
        """Record the columns `writer` sets in any Batch inside the block; check those set in `batch`."""
        self.writer, before = writer, set(self.by[writer])
        try:
            yield
        finally:
            self.writer = None
        self._check(writer, batch, self.by[writer] - before)

    def returned(self, writer: str, columns) -> Batch:
        """A writer's result (Batch, TensorDict or dict of numpy columns): record and check its keys."""
        batch = columns if isinstance(columns, Batch) else Batch(
            {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)},
            {k: v for k, v in columns.items() if not isinstance(v, torch.Tensor)})
        self.by[writer] |= set(batch.keys())
        self._check(writer, batch, set(batch.keys()))
        return batch

    @staticmethod
    def _check(writer: str, batch: Batch, keys: set[str]) -> None:
        unlisted = sorted(k for k in keys if k not in FIELDS)
        assert not unlisted, f"{writer} writes columns {unlisted} that ballast/protocol/fields.py does not list"
        check_fields(batch, sorted(keys))


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    rec = Recorder()
    setitem = Batch.__setitem__

    def recording(batch, key, value):
        if rec.writer is not None:
            rec.by[rec.writer].add(key)
        setitem(batch, key, value)

    monkeypatch.setattr(Batch, "__setitem__", recording)
    return rec


class _Engine:
    """A train engine's inference face: zeros of the right shape (no FLOPs model: no MFU)."""

    workload = None

    def infer_batch(self, data, mini_batch, temperature=1.0, calculate_entropy=False):
        zeros = torch.zeros(data["responses"].shape, dtype=torch.float32)
        return {"log_probs": zeros, "entropy": zeros, "values": zeros}


def _worker():
    """The actor/ref/critic worker methods' `self`: stand-in engines, no MFU peak, no LoRA reference."""
    engine = _Engine()
    return SimpleNamespace(actor=engine, ref=engine, critic=engine, _peak_flops=None,
                           spec=SimpleNamespace(temperature=1.0, ref_in_actor=False), _require=lambda e, role: e)


def _conversations() -> list[AgentLoopOutput]:
    return [AgentLoopOutput(prompt_ids=p, response_ids=r, response_mask=[1] * len(r), log_probs=[-0.5] * len(r),
                            stop_reason=StopReason.ANSWER, num_turns=2, info={"tool_calls": 1.0},
                            token_versions=[3] * len(r), tool_rewards=[0.5])
            for p, r in zip(PROMPTS, RESPONSES)]


def _generate(rec: Recorder, prompts: Batch) -> Batch:
    """The rollout's output builder (agent loops) on the data's prompts; its batch goes on, with the
    prompts' own columns kept (as the worker returns it)."""
    layout = [prompts[k] for k in ("input_ids", "attention_mask", "position_ids")]
    out = rec.returned(F.ROLLOUT, assemble(*layout, _conversations(), pad_token_id=PAD, prompt_length=3,
                                           response_length=RESPONSE_LEN, with_log_probs=True))
    columns = rec.returned(F.AGENT_LOOP, sample_columns(_conversations(), ["tool_agent"] * len(PROMPTS)))
    return Batch(out.tensors, {**prompts.non_tensors, **columns.non_tensors})


def _plan(batch: Batch):
    lengths = batch["attention_mask"].sum(-1).numpy()
    return plan_phase(lengths, 1, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=2))


def _step(rec: Recorder) -> None:
    worker = _worker()
    collated = PromptCollator(PAD)([{"input_ids": torch.tensor(p)} for p in PROMPTS])
    prompts = rec.returned(F.DATA, collated_to_batch(collated, "step1"))
    batch = _generate(rec, prompts)
    plan = _plan(batch)
    with rec.writing(F.REWARD, batch):
        RayPPOTrainer._score(SimpleNamespace(reward=lambda b, step: (torch.zeros(b["responses"].shape), {})), batch, 1)
    actor = SimpleNamespace(compute_log_prob=lambda b, p: ActorRolloutRefWorker.compute_log_prob(worker, b, p))
    rec.returned(F.ACTOR, actor.compute_log_prob(batch[plan.rows], plan).batch)
    with rec.writing(F.ACTOR, batch):
        run_pass(actor, batch, plan)
        zeros = torch.zeros(batch["responses"].shape)
        take_from_update(batch, [UpdateResult({}, [[1]], old_log_probs=zeros, entropy=zeros)], plan)
    ref = lambda b, p: rec.returned(F.REF, ActorRolloutRefWorker.compute_ref_log_prob(worker, b, p))
    with rec.writing(F.REF, batch):
        RayPPOTrainer.infer(batch, ref, plan)
    values = lambda b, p: rec.returned(F.CRITIC, CriticWorker.compute_values(worker, b, p))
    with rec.writing(F.CRITIC, batch):
        RayPPOTrainer.infer(batch, values, plan)
    alg = SimpleNamespace(use_kl_in_reward=True, kl_penalty="kl", adv_estimator="gae", gamma=1.0, lam=1.0,
                          norm_adv_by_std_in_grpo=True)
    with rec.writing(F.ADVANTAGES, batch):
        rewards_and_advantages(batch, alg, make_kl_controller("fixed", 0.001, 0.1, 10000),
                               RolloutCorrectionPhase(parse_rollout_correction()), lambda _: contextlib.nullcontext())
    _correct(rec, batch, plan)


def _correct(rec: Recorder, batch: Batch, plan) -> None:
    """Decoupled mode (weights and rejection before the advantages), then bypass mode on a copy."""
    decoupled = RolloutCorrectionPhase(parse_rollout_correction(rollout_is="token", rollout_rs="token_k1",
                                                                rollout_rs_threshold="0.5_2.0"))
    with rec.writing(F.CORRECTION, batch):
        decoupled.before_advantages(batch)
    bypass = RolloutCorrectionPhase(parse_rollout_correction(bypass_mode=True, loss_type="reinforce",
                                                             rollout_is="token"))
    fresh = batch.select(["responses", "response_mask", "rollout_log_probs", "attention_mask"])
    with rec.writing(F.CORRECTION, fresh):
        rows = np.concatenate([plan.partitions(m)[0] for m in range(len(plan.mini_batches))])
        bypass.after_update(fresh, plan, [SimpleNamespace(train_log_probs=fresh["rollout_log_probs"][torch.as_tensor(rows)])])


def test_every_column_written_is_listed_and_attributed_to_its_writer(recorder):
    _step(recorder)
    written = {w: sorted(keys) for w, keys in recorder.by.items()}
    listed = {w: sorted(n for n, s in FIELDS.items() if w in s.written_by) for w in F.WRITERS}
    assert written == {w: keys for w, keys in listed.items() if keys}, "the table's 'written by' differs from the code"
    # every listed field is written by someone (a column no code writes any more cannot stay listed)
    assert set().union(*recorder.by.values()) == set(FIELDS)


def test_a_column_missing_from_the_table_fails_with_its_writer(recorder, monkeypatch):
    monkeypatch.delitem(FIELDS, "entropy")
    with pytest.raises(AssertionError, match=r"actor writes columns \['entropy'\] that .*fields.py does not list"):
        _step(recorder)


def _literal_writes(tree: ast.AST):
    """(line, key) of `<...>batch["key"] = ...` (tuple targets too) and `Batch({"key": ...}, ...)`."""

    def subscripts(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                yield from subscripts(element)
        elif isinstance(target, ast.Subscript):
            yield target

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in subscripts(target):
                    owner = sub.value.id if isinstance(sub.value, ast.Name) else getattr(sub.value, "attr", None)
                    if owner == "batch" and isinstance(sub.slice, ast.Constant) and isinstance(sub.slice.value, str):
                        yield node.lineno, sub.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Batch":
            parts = list(node.args[:2]) + [k.value for k in node.keywords if k.arg in ("tensors", "non_tensors")]
            for part in parts:
                if isinstance(part, ast.Dict):
                    yield from ((node.lineno, k.value) for k in part.keys
                                if isinstance(k, ast.Constant) and isinstance(k.value, str))


def test_no_literal_column_write_in_the_package_is_missing_from_the_table():
    found, unlisted = 0, []
    for path in sorted(PKG.rglob("*.py")):
        for line, key in _literal_writes(ast.parse(path.read_text(), filename=str(path))):
            found += 1
            if key not in FIELDS:
                unlisted.append(f"{path.relative_to(PKG.parent)}:{line} writes {key!r}")
    assert found >= 10, "the scan no longer sees the package's column writes: update _literal_writes"
    assert not unlisted, "columns missing from ballast/protocol/fields.py:\n" + "\n".join(unlisted)


def test_the_scan_sees_both_literal_forms():
    source = 'u.batch["a"], batch["b"] = x\nBatch({"c": t}, non_tensors={"d": n})\nmetrics["e"] = 1\n'
    assert sorted(key for _, key in _literal_writes(ast.parse(source))) == ["a", "b", "c", "d"]


def _loss_batch(rows=4, width=RESPONSE_LEN) -> Batch:
    """Every tensor field a loss could want, so that `engine_input` decides what the loss gets."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, width, dtype=torch.int64)
    tensors = {"input_ids": torch.ones(rows, 2 + width, dtype=torch.int64), "responses": torch.ones(rows, width,
               dtype=torch.int64), "response_mask": mask}
    for name, spec in FIELDS.items():
        if spec.is_tensor and name not in tensors and spec.shape == ("B", "R") and spec.dtype == torch.float32:
            tensors[name] = -torch.rand(rows, width, generator=gen)
    tensors["rollout_is_norm_sum"] = torch.full((rows,), float(width), dtype=torch.float64)
    tensors["rollout_is_norm_count"] = torch.full((rows,), float(width), dtype=torch.float64)
    return Batch(tensors)


@pytest.mark.parametrize("settings", [
    dict(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01),
    dict(rollout_correction=parse_rollout_correction(rollout_is="token", rollout_is_batch_normalize=True)),
    dict(rollout_correction=parse_rollout_correction(bypass_mode=True, loss_type="reinforce", rollout_is="token")),
])
def test_the_losses_need_no_column_beyond_what_the_table_says_they_read(settings):
    batch = _loss_batch()
    micro = engine_input(batch, F.columns_read_by(F.ACTOR_LOSS))
    assert "entropy" not in micro.keys()  # not a loss input
    assert "rollout_log_probs" in micro.keys()  # bypass mode's old policy
    outputs = {"log_probs": -torch.rand(micro["responses"].shape), "entropy": torch.rand(micro["responses"].shape)}
    loss_fn = make_actor_loss(ActorLossConfig(**settings))
    norm = GlobalNorm.local(micro["response_mask"])
    stat = getattr(loss_fn, "mini_batch_statistic", None)
    if stat is not None:  # what the engine sums over the mini-batch before the loss runs
        norm = norm.with_stats(dict(zip(stat.keys, stat(outputs, micro))))
    loss, _ = loss_fn(outputs, micro, norm)
    assert torch.isfinite(loss)
    critic_micro = engine_input(batch, F.columns_read_by(F.CRITIC_LOSS))
    loss, _ = critic_loss({"values": torch.zeros(micro["responses"].shape)}, critic_micro,
                          GlobalNorm.local(critic_micro["response_mask"]), cfg=CriticLossConfig())
    assert torch.isfinite(loss)
