"""GRPO step time: Ballast's full step (trainer, Ray workers, vLLM) against TRL's `GRPOTrainer` on the
same work, with Ballast's per-phase breakdown and MFU against a matmul peak measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_bench.py --json out.json

Cases:

* `quickstart`: the tiny Qwen2 model and synthetic repeat task of scripts/quickstart.sh (built into
  .cache/quickstart if absent), 16 prompts x 8 samples, <= 64 new tokens, 2 optimizer steps per step.
* `real`: any Hugging Face model directory + a train parquet (verl layout: prompt, data_source,
  reward_model.ground_truth) + optionally a reward function name registered in `ballast.data.rewards`
  (`--real-model-dir`, `--real-train-file`, `--real-reward`); 8 prompts x 4 samples, <= 32 new
  tokens, 1 optimizer step per step by default. Skipped, with the reason in the JSON, when the model
  directory or parquet file is absent.

Same work on both sides: same model files, prompt rows (first rows of the parquet, no shuffle),
reward function, samples per step, max new tokens, optimizer steps per step, lr, AdamW weight decay
and grad clip, constant schedule, no KL, sampling temperature 1 without top-k/top-p. Ballast runs
`--workers` CPU worker processes with one thread each (`python -m ballast.trainer.main`, as a user
runs it; `--threads-per-worker T`: workers / T processes of T threads, `trainer.cpus_per_worker=T`);
TRL runs in one process with `torch.set_num_threads(workers)`, so both use the same cores.

LoRA (`--lora RANK`): each repeat also runs Ballast with a rank-RANK, alpha-2xRANK all-linear adapter
(variant `lora`, adapter-only weight sync into vLLM, the weight-sync check on) and, with TRL in
`--systems` (or `trl_lora` alone, without TRL's full fine-tune), TRL's `GRPOTrainer` with the same PEFT
adapter (`trl_lora`); the summary's `lora` entry
gives LoRA against the full fine-tune on the same work (step, update, weight-sync time and each
worker's peak resident memory, paired per repeat) and against TRL+PEFT. `--lora-lr` sets its learning
rate (default: the case's).

Each system trains `--warmup + --steps` steps; s/step is the median over the last `--steps`
(`--tail-steps N`: Ballast trains N more, unmeasured, so that the window of a run that generates
batches ahead holds no end-of-run step). Ballast's
phases are the medians of its own `timing_s/*` metrics. Ballast runs the CPU quickstart config, which
shares prompts (`actor_rollout_ref.actor.use_prefix_grouper`: each prompt runs once for its samples in
the actor's passes; `--variant rows=actor_rollout_ref.actor.use_prefix_grouper=False` runs every row's
own copy). MFU: update FLOPs (3 x forward FLOPs of the tokens the update runs, from the model's config:
the step's tokens times the run's `shared_token_fraction`) / (update seconds x peak), peak =
`--workers` x the best single-thread fp32 matmul rate measured here before the runs.
`--variant NAME=override,override` (repeatable) runs extra Ballast configurations; `--repeats R` interleaves all variants R times
(A, B, A, B, ...) so that a loaded machine affects them alike; an item `@PATH` in a variant runs the
Ballast source tree at PATH instead of this one (e.g. `git archive <commit>` unpacked), so a change
can be measured against the code before it.

`--bf16`: both systems compute in bf16 with fp32 master weights (Ballast:
`fsdp_config.mixed_precision.param_dtype=bf16` and a bf16 vLLM rollout; TRL: `bf16=True`, autocast);
the floor and MFU stay measured against the fp32 matmul peak, so they do not apply then.

`--whole-run` runs each case for as long as a user runs it (the quickstart's 120 steps, the real case
`--real-whole-run-steps`, 30): beside the window, `whole_run` (per run) and `*_whole_run_s_per_step`
(per case) average every step, warm-up and early short-response steps included, where fixed per-step
costs weigh most. Neither figure counts process start-up. `machine.cpu` records the CPU model, its
matmul-relevant instruction sets and the kernel level torch uses: figures from different CPUs do not
compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also when loaded by path
from machine import cpu_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QS = os.path.join(ROOT, ".cache", "quickstart")
PHASES = {  # output name -> Ballast timing_s key
    "generate": "gen", "weight_sync": "update_weights", "reward": "reward", "balance": "balance",
    "old_log_prob": "old_log_prob",
    "ref": "ref", "adv": "adv", "update": "update_actor", "rollout_corr": "rollout_corr",
}


@dataclass
class Case:
    name: str
    model_dir: str
    train_file: str
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    max_prompt_length: int
    optimizer_steps_per_step: int
    lr: float
    max_token_len_per_worker: int
    reward: Optional[str] = None  # None: the built-in reward of each row's data_source
    extra_overrides: List[str] = field(default_factory=list)
    lora_rank: int = 0  # > 0: a LoRA adapter (PEFT, all-linear) instead of full fine-tuning (TRL side)
    lora_alpha: float = 0.0
    whole_run_steps: int = 30  # the length of a run as a user runs it (`--whole-run`)
    bf16: bool = False  # both systems compute in bf16 (`--bf16`)


def matmul_peak_flops(threads: int, seconds: float = 1.5) -> float:
    """Best fp32 matmul FLOP/s on `threads` threads, measured as the trainer's workers measure it."""
    import torch

    from ballast.workers.perf import cpu_matmul_peak_flops

    torch._C.set_num_threads(threads)
    return cpu_matmul_peak_flops(seconds=seconds)


def whole_run(per_step: List[float]) -> dict:
    """Every step of a run, warm-up included: what a user waits for, beside the steady-state window."""
    return {"steps": len(per_step), "total_s": sum(per_step),
            "s_per_step_mean": sum(per_step) / len(per_step) if per_step else None}


def forward_flops(model_dir: str, tokens_per_sample: float, response_tokens_per_sample: float,
                  samples: int) -> tuple[float, float]:
    """Forward FLOPs of `samples` sequences of the mean length (linear terms + causal attention): the
    model's (every token through the LM head) and those executed, without the LM head on prompt tokens
    (the training forward projects only the positions that predict response tokens onto the vocabulary)."""
    from ballast.balance import FlopsModel

    with open(os.path.join(model_dir, "config.json")) as f:
        model = FlopsModel.from_hf_config(json.load(f))
    flops = float(model([max(1, round(tokens_per_sample))])[0]) * samples
    head_per_token = 2.0 * model.hidden_size * model.vocab_size
    prompt_tokens = max(0.0, tokens_per_sample - response_tokens_per_sample)
    return flops, flops - head_per_token * prompt_tokens * samples


# ------------------------------------------------------------------ Ballast
def _env(tmp: str, root: str = ROOT) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", BALLAST_CACHE_DIR=os.path.join(ROOT, ".cache"),
               VLLM_CACHE_ROOT=os.path.join(ROOT, ".cache", "vllm"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(ROOT, ".cache", "inductor"))
    env["PYTHONPATH"] = root
    return env


def ballast_overrides(case: Case, steps: int, workers: int, out_dir: str, threads_per_worker: int = 1) -> List[str]:
    mini = case.prompts_per_step // case.optimizer_steps_per_step
    overrides = [
        f"data.train_files={case.train_file}", "data.val_files=null", "data.shuffle=false",
        f"data.max_prompt_length={case.max_prompt_length}", f"data.max_response_length={case.max_new_tokens}",
        f"data.train_batch_size={case.prompts_per_step}", f"actor_rollout_ref.model.path={case.model_dir}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={case.max_token_len_per_worker}",
        f"actor_rollout_ref.actor.optim.lr={case.lr}", "actor_rollout_ref.actor.use_kl_loss=false",
        f"actor_rollout_ref.rollout.n={case.samples_per_prompt}", "actor_rollout_ref.rollout.temperature=1.0",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        "trainer.device=cpu", "trainer.nnodes=1", f"trainer.n_gpus_per_node={workers // threads_per_worker}",
        f"trainer.cpus_per_worker={threads_per_worker}",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out_dir}",
    ]
    if case.bf16:
        overrides += ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                      "actor_rollout_ref.rollout.dtype=bfloat16"]
    if case.reward:  # a two-line reward file naming the registered function, loaded as a custom reward
        path = os.path.join(os.path.dirname(out_dir), "named_reward.py")
        with open(path, "w") as f:
            f.write("from ballast.data.rewards import get_reward_fn\n"
                    f"compute_score = get_reward_fn({case.reward!r})\n")
        overrides += [f"custom_reward_function.path={path}", "custom_reward_function.name=compute_score"]
    return overrides + case.extra_overrides


def run_ballast(case: Case, warmup: int, steps: int, workers: int, overrides: List[str], log_dir: str,
                tail: int = 0, threads_per_worker: int = 1) -> dict:
    # "@PATH" runs the Ballast source tree at PATH (e.g. an export of an older commit) for an A/B.
    root = next((o[1:] for o in overrides if o.startswith("@")), ROOT)
    overrides = [o for o in overrides if not o.startswith("@")]
    with tempfile.TemporaryDirectory(prefix="step_bench_") as tmp:
        out_dir = os.path.join(tmp, "run")
        cmd = [sys.executable, "-m", "ballast.trainer.main", "--config-name", "quickstart",
               *ballast_overrides(case, warmup + steps + tail, workers, out_dir, threads_per_worker), *overrides]
        log = os.path.join(log_dir, f"ballast_{case.name}_{int(time.time())}.log")
        start = time.perf_counter()
        with open(log, "w") as f:
            # cwd = the source tree: `python -m` puts the working directory first on sys.path.
            proc = subprocess.run(cmd, cwd=root, env=_env(tmp, root), stdout=f, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"ballast run failed (exit {proc.returncode}); see {log}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        # every step's metrics next to the log, for whatever the summary does not report
        shutil.copy(os.path.join(out_dir, "metrics.jsonl"), log[: -len(".log")] + ".metrics.jsonl")
    rows = [r for r in rows if "timing_s/step" in r][: warmup + steps]  # --tail-steps are not measured
    whole = whole_run([r["timing_s/step"] for r in rows])
    rows = rows[warmup:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    phases = {name: med(f"timing_s/{key}") for name, key in PHASES.items()}
    # Weight sync and its check (LoRA runs) run inside the generate call; report generation without them.
    phases["sync_check"] = med("rollout/sync_check/seconds")
    phases["generate"] = max(0.0, phases["generate"] - phases["weight_sync"] - phases["sync_check"])
    step_s = med("timing_s/step")
    phases["other"] = max(0.0, step_s - sum(phases.values()))
    tokens = med("perf/total_num_tokens")
    samples = case.prompts_per_step * case.samples_per_prompt
    return {
        "s_per_step": step_s, "s_per_step_all": [r["timing_s/step"] for r in rows], "phases": phases,
        "tokens_per_step": tokens, "tokens_per_s": tokens / step_s, "samples": samples,
        "response_length_mean": med("response_length/mean"), "score_mean": med("critic/score/mean"),
        # the executed share of the rows' tokens in the actor's passes (< 1 with shared prompts)
        "shared_token_fraction": statistics.median(r.get("balance/actor_plan/shared_token_fraction", 1.0) for r in rows),
        "trainer_mfu_actor": med("perf/mfu/actor") if "perf/mfu/actor" in rows[0] else None,
        # the rank-0 worker's peak resident memory (trainer + vLLM engine), at the last step
        "max_rss_gb": rows[-1].get("perf/max_rss_gb"),
        "wall_s": wall, "log": log, "overrides": overrides, "source_tree": root, "whole_run": whole,
    }


# ------------------------------------------------------------------ TRL
def trl_main(case: Case, warmup: int, steps: int, threads: int, result_path: str) -> None:
    """Runs in its own process: TRL GRPOTrainer on the case's work, per-step wall times to JSON."""
    import torch

    torch._C.set_num_threads(threads)
    import pandas as pd
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ballast.data.rewards import default_compute_score, get_reward_fn
    from ballast.models.tokenizer import load_tokenizer

    df = pd.read_parquet(case.train_file).head(case.prompts_per_step * (warmup + steps))
    data = Dataset.from_dict({
        "prompt": [[dict(m) for m in p] for p in df["prompt"]],
        "data_source": df["data_source"].astype(str).tolist(),
        "ground_truth": [rm["ground_truth"] for rm in df["reward_model"]],
    })
    score = (lambda src, text, truth: get_reward_fn(case.reward)(src, text, truth, None)) if case.reward else \
        (lambda src, text, truth: default_compute_score(src, text, truth, None))

    def reward(prompts, completions, data_source, ground_truth, **_):
        out = []
        for comp, src, truth in zip(completions, data_source, ground_truth):
            text = comp[-1]["content"] if isinstance(comp, list) else comp
            value = score(src, text, truth)
            out.append(float(value["score"] if isinstance(value, dict) else value))
        return out

    samples = case.prompts_per_step * case.samples_per_prompt
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(result_path), "trl_out"), use_cpu=True, seed=1,
        per_device_train_batch_size=samples // case.optimizer_steps_per_step, gradient_accumulation_steps=1,
        steps_per_generation=case.optimizer_steps_per_step, num_generations=case.samples_per_prompt,
        max_completion_length=case.max_new_tokens, learning_rate=case.lr, lr_scheduler_type="constant",
        weight_decay=0.01, max_grad_norm=1.0, beta=0.0, temperature=1.0, top_k=0, top_p=1.0,
        loss_type="dapo", scale_rewards="group", num_iterations=1, shuffle_dataset=False,
        max_steps=(warmup + steps) * case.optimizer_steps_per_step, logging_steps=1, report_to=[],
        save_strategy="no", bf16=case.bf16, dataloader_num_workers=0, disable_tqdm=True,
    )
    marks: List[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            marks.append(time.perf_counter())

    model = AutoModelForCausalLM.from_pretrained(case.model_dir, dtype=torch.float32)
    peft_config = None
    if case.lora_rank > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(r=case.lora_rank, lora_alpha=case.lora_alpha, target_modules="all-linear",
                                 lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=load_tokenizer(case.model_dir), callbacks=[Clock()],
                          peft_config=peft_config)
    start = time.perf_counter()
    trainer.train()
    k = case.optimizer_steps_per_step
    ends = [start] + marks[k - 1::k]  # end of every full step (one generation + k optimizer steps)
    per_step = [b - a for a, b in zip(ends, ends[1:])]
    # completion lengths, to compare the work done: responses stop at EOS in both systems, and the
    # two policies learn apart, so the generated tokens per step can drift apart over a run
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    import resource

    with open(result_path, "w") as f:
        json.dump({"per_step_s": per_step, "response_length_mean": lengths[k - 1::k],
                   "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}, f)


def run_trl(case: Case, warmup: int, steps: int, threads: int, log_dir: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="step_bench_trl_") as tmp:
        result = os.path.join(tmp, "trl.json")
        log = os.path.join(log_dir, f"trl_{case.name}_{int(time.time())}.log")
        cmd = [sys.executable, os.path.abspath(__file__), "--_trl", json.dumps(asdict(case)),
               "--warmup", str(warmup), "--steps", str(steps), "--workers", str(threads), "--_result", result]
        env = _env(tmp)
        env["OMP_NUM_THREADS"] = str(threads)
        start = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"TRL run failed (exit {proc.returncode}); see {log}")
        with open(result) as f:
            out = json.load(f)
    per_step, lengths = out["per_step_s"][warmup:], out.get("response_length_mean", [])[warmup:]
    return {"s_per_step": statistics.median(per_step), "s_per_step_all": per_step,
            "whole_run": whole_run(out["per_step_s"]),
            "response_length_mean": statistics.median(lengths) if lengths else None,
            "max_rss_gb": out.get("max_rss_gb"), "wall_s": time.perf_counter() - start, "log": log}


# ------------------------------------------------------------------ driver
def build_cases(args) -> List[Case]:
    cases = []
    if "quickstart" in args.cases:
        cases.append(Case("quickstart", os.path.join(QS, "model"), os.path.join(QS, "data", "train.parquet"),
                          prompts_per_step=16, samples_per_prompt=8, max_new_tokens=64, max_prompt_length=64,
                          optimizer_steps_per_step=2, lr=1e-3, max_token_len_per_worker=1024,
                          whole_run_steps=120))  # the README quickstart's length
    if "real" in args.cases:
        cases.append(Case("real", args.real_model_dir or "", args.real_train_file or "",
                          prompts_per_step=args.real_prompts, samples_per_prompt=args.real_n,
                          max_new_tokens=args.real_max_new_tokens, max_prompt_length=args.real_max_prompt_length,
                          optimizer_steps_per_step=args.real_optimizer_steps, lr=args.real_lr,
                          max_token_len_per_worker=args.real_max_token_len, reward=args.real_reward,
                          whole_run_steps=args.real_whole_run_steps))
    return [dataclasses.replace(case, bf16=True) for case in cases] if args.bf16 else cases


def ensure_quickstart() -> None:
    if os.path.isfile(os.path.join(QS, "model", "config.json")) and os.path.isfile(os.path.join(QS, "data", "train.parquet")):
        return
    env = _env(ROOT)
    subprocess.run([sys.executable, "-m", "ballast.models.tiny", "--out", os.path.join(QS, "model"), "--preset", "tiny",
                    "--seed", "0"], cwd=ROOT, env=env, check=True)
    subprocess.run([sys.executable, "examples/data/make_synthetic.py", "--out", os.path.join(QS, "data"), "--train-size",
                    "2048", "--val-size", "64", "--k-median", "8", "--k-max", "60", "--symbols", "#"],
                   cwd=ROOT, env=env, check=True)


def _median_or_none(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _paired(a_runs: List[dict], b_runs: List[dict], value) -> dict:
    """Median of a/b over runs paired by repeat (drift hits both alike), with every pair's ratio."""
    pairs = []
    for a, b in zip(a_runs, b_runs):
        x, y = value(a), value(b)
        if x is not None and y:
            pairs.append(x / y)
    return {"median": _median_or_none(pairs), "pairs": pairs}


def lora_summary(full: List[dict], lora: List[dict], trl_lora: List[dict]) -> Optional[dict]:
    """LoRA against the full fine-tune on the same work, and against TRL with the same PEFT adapter."""
    if not lora:
        return None
    med = lambda runs, f: _median_or_none([f(r) for r in runs if f(r) is not None])  # noqa: E731
    return {
        "s_per_step": med(lora, lambda r: r["s_per_step"]),
        "phases": {k: med(lora, lambda r, k=k: r["phases"][k]) for k in lora[0]["phases"]},
        "max_rss_gb": med(lora, lambda r: r.get("max_rss_gb")),
        "full_max_rss_gb": med(full, lambda r: r.get("max_rss_gb")),
        "step_vs_full": _paired(lora, full, lambda r: r["s_per_step"]),
        "update_vs_full": _paired(lora, full, lambda r: r["phases"]["update"]),
        "full_sync_vs_lora_sync": _paired(full, lora, lambda r: r["phases"]["weight_sync"]),
        "rss_vs_full": _paired(lora, full, lambda r: r.get("max_rss_gb")),
        "trl_lora_s_per_step": med(trl_lora, lambda r: r["s_per_step"]),
        "trl_lora_max_rss_gb": med(trl_lora, lambda r: r.get("max_rss_gb")),
        "step_vs_trl_lora": _paired(lora, trl_lora, lambda r: r["s_per_step"]),
        "response_length_mean": med(lora, lambda r: r["response_length_mean"]),
        "trl_lora_response_length_mean": med(trl_lora, lambda r: r.get("response_length_mean")),
    }


def summarise(case: Case, variants: Dict[str, List[dict]], trl: List[dict], peak_total: float,
              trl_lora: Optional[List[dict]] = None) -> dict:
    trl_lora = trl_lora or []
    out = {"name": case.name, "work": asdict(case), "variants": {}}
    for name, runs in variants.items():
        s = statistics.median(r["s_per_step"] for r in runs)
        phases = {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
        tokens = statistics.median(r["tokens_per_step"] for r in runs)
        fwd, executed = forward_flops(case.model_dir, tokens / runs[0]["samples"],
                                      statistics.median(r["response_length_mean"] for r in runs), runs[0]["samples"])
        # With shared prompts the actor's passes run each prompt once: their FLOPs (the floor and MFU's
        # numerator) scale with the executed share of the tokens (linear terms exactly; attention, a
        # few percent here, proportionally). Generation keeps the rows' FLOPs.
        shared = statistics.median(r.get("shared_token_fraction", 1.0) for r in runs)
        gen_fwd, fwd, executed = fwd, fwd * shared, executed * shared

        # Utilisation per run against the peak measured just before that run (the VM's speed drifts by
        # tens of percent within an hour, so a peak measured minutes earlier misstates it), then the median.
        def utilisation(flops: float, seconds: Callable[[dict], float], min_s: float) -> Optional[float]:
            return _median_or_none([flops / (seconds(r) * r.get("peak_flops_total", peak_total))
                                    for r in runs if seconds(r) > min_s])

        # By default (`old_log_prob_from_update`) the old log-probs come from the update: its forward-only
        # pass covers the rows after the first of k mini-batches, (k - 1) / k of them, and runs inside
        # the update phase, whose compute is then the update's time without it. Otherwise a separate
        # pass covers every row.
        separate = any(o.replace(" ", "").lower() == "actor_rollout_ref.actor.old_log_prob_from_update=false"
                       for o in runs[0]["overrides"])
        k = case.optimizer_steps_per_step
        lp_fwd = fwd if separate else fwd * (k - 1) / k
        def update_s(r: dict) -> float:
            return r["phases"]["update"] - (0.0 if separate else r["phases"]["old_log_prob"])

        mfu_update = utilisation(3.0 * fwd, update_s, 0.0)
        hfu_update = utilisation(3.0 * executed, update_s, 0.0)  # LM head on response positions only
        mfu_lp = utilisation(lp_fwd, lambda r: r["phases"]["old_log_prob"], 0.01)
        # Compute floor at the measured peak: generation passes every token through the model once
        # (prefill + decode), the update three times (forward + backward); the old-log-prob pass once
        # over the rows it covers, unless the run skipped it.
        floor = {"generate": gen_fwd / peak_total, "update": 3.0 * fwd / peak_total,
                 "old_log_prob": lp_fwd / peak_total if phases["old_log_prob"] > 0.01 else 0.0}
        floor["step"] = sum(floor.values())
        out["variants"][name] = {"s_per_step": s, "phases": phases, "tokens_per_s": tokens / s,
                                 "forward_flops_per_step": fwd, "floor_s": floor, "over_floor": s / floor["step"],
                                 "mfu_update": mfu_update, "hfu_update": hfu_update, "mfu_log_prob": mfu_lp,
                                 "executed_forward_flops_per_step": executed, "shared_token_fraction": shared,
                                 "runs": runs}
    # Only the default configuration does TRL's work; without it (its runs failed) no ratio is given.
    base = out["variants"].get("default", {})
    out["ballast_s_per_step"], out["phases"] = base.get("s_per_step"), base.get("phases")
    for key in ("tokens_per_s", "mfu_update", "hfu_update", "mfu_log_prob", "floor_s", "over_floor"):
        out[key] = base.get(key)
    out["trl_s_per_step"] = statistics.median(r["s_per_step"] for r in trl) if trl else None
    out["lora"] = lora_summary(variants.get("default", []), variants.get("lora", []), trl_lora)
    out["ratio_vs_trl"] = out["ballast_s_per_step"] / out["trl_s_per_step"] \
        if trl and out["ballast_s_per_step"] else None
    # each repeat's Ballast run against the TRL run right after it, so slow drift hits both alike
    pairs = [b["s_per_step"] / t["s_per_step"] for b, t in zip(base.get("runs", []), trl)]
    out["ratio_vs_trl_paired"] = pairs
    out["peak_flops_total_per_run"] = [r.get("peak_flops_total") for r in base.get("runs", []) + trl]
    out["trl_runs"] = trl
    # every step of the run, warm-up included: the figure a user of a whole run sees
    out["ballast_whole_run_s_per_step"] = _median_or_none([r["whole_run"]["s_per_step_mean"] for r in base.get("runs", [])])
    out["trl_whole_run_s_per_step"] = _median_or_none([r["whole_run"]["s_per_step_mean"] for r in trl])
    out["whole_run_ratio_vs_trl"] = out["ballast_whole_run_s_per_step"] / out["trl_whole_run_s_per_step"] \
        if out["ballast_whole_run_s_per_step"] and out["trl_whole_run_s_per_step"] else None
    # the work each system actually generated (median response tokens per sample over the timed steps)
    out["ballast_response_length_mean"] = statistics.median(r["response_length_mean"] for r in base.get("runs", [])) \
        if base.get("runs") else None
    trl_lengths = [r["response_length_mean"] for r in trl if r.get("response_length_mean") is not None]
    out["trl_response_length_mean"] = statistics.median(trl_lengths) if trl_lengths else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--cases", default="quickstart,real")
    p.add_argument("--systems", default="ballast,trl")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tail-steps", type=int, default=0,
                   help="Ballast runs this many steps after the window, unmeasured: with batches generated "
                        "ahead a run's last steps generate nothing ahead, so they are not steady-state steps")
    p.add_argument("--whole-run", action="store_true",
                   help="run each case for a whole run (quickstart 120 steps, real --real-whole-run-steps); the "
                        "window is still the steps after --warmup, `whole_run` covers every step")
    p.add_argument("--real-whole-run-steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=2, help="Ballast's CPU cores (workers of 1 thread each) = TRL's threads")
    p.add_argument("--threads-per-worker", type=int, default=1,
                   help="Ballast runs --workers / this many worker processes of this many threads each")
    p.add_argument("--trl-threads", type=int, help="TRL's torch threads (default: --workers, the same cores)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=hydra.override,other.override[,@SOURCE_TREE]: an extra Ballast configuration")
    p.add_argument("--real-model-dir")
    p.add_argument("--real-train-file")
    p.add_argument("--real-reward", help="a reward name registered in ballast.data.rewards (default: per data_source)")
    p.add_argument("--real-prompts", type=int, default=8)
    p.add_argument("--real-n", type=int, default=4)
    p.add_argument("--real-max-new-tokens", type=int, default=32)
    p.add_argument("--real-max-prompt-length", type=int, default=256)
    p.add_argument("--real-optimizer-steps", type=int, default=1)
    p.add_argument("--real-lr", type=float, default=1e-6)
    p.add_argument("--real-max-token-len", type=int, default=4096)
    p.add_argument("--bf16", action="store_true",
                   help="both systems compute in bf16 (Ballast: mixed_precision bf16 + bf16 vLLM; TRL: bf16=True)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="also run a rank-RANK all-linear LoRA adapter (Ballast variant `lora`, TRL with PEFT)")
    p.add_argument("--lora-lr", type=float, help="the LoRA runs' learning rate (default: the case's)")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "outputs", "step_bench"))
    p.add_argument("--_trl", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._trl:
        return trl_main(Case(**json.loads(args._trl)), args.warmup, args.steps, args.workers, args._result)
    if args.threads_per_worker < 1 or args.workers % args.threads_per_worker:
        p.error(f"--threads-per-worker {args.threads_per_worker} must be >= 1 and divide --workers {args.workers}")
    os.makedirs(args.log_dir, exist_ok=True)
    variants = {"default": []}
    if args.lora:  # the case's lr is only known per case: "{lr}" is filled in below
        variants["lora"] = [f"actor_rollout_ref.model.lora_rank={args.lora}",
                            f"actor_rollout_ref.model.lora_alpha={2 * args.lora}",
                            "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.actor.optim.lr={lr}"]
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        variants[name] = [o for o in rest.split(",") if o]
    systems = args.systems.split(",")
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        # Checked before any run: otherwise the Ballast runs take minutes and every TRL run then fails.
        p.error("--systems includes trl, which is not installed: bash scripts/setup.sh --bench "
                "(or drop it: --systems ballast)")
    peak_1 = matmul_peak_flops(1)
    peak_total = peak_1 * args.workers
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
                          "cpu": cpu_info()},
              "matmul_peak_flops_per_thread": peak_1, "matmul_peak_flops_total": peak_total,
              "workers": args.workers, "threads_per_worker": args.threads_per_worker, "trl_threads": args.trl_threads or args.workers, "warmup": args.warmup, "steps": args.steps, "cases": [], "skipped": []}
    for case in build_cases(args):
        if case.name == "quickstart":
            ensure_quickstart()
        missing = [p for p in (case.model_dir, case.train_file) if not p or not os.path.exists(p)]
        if missing:
            msg = f"case {case.name!r} skipped: missing {missing} (pass --real-model-dir and --real-train-file)"
            print(msg, flush=True)
            result["skipped"].append({"name": case.name, "reason": msg})
            continue
        # a whole run: the case's own length, the window still excludes the first --warmup steps
        steps = case.whole_run_steps - args.warmup if args.whole_run else args.steps
        if steps < 1:
            raise SystemExit(f"--warmup {args.warmup} leaves no step of the {case.whole_run_steps}-step {case.name} run")
        runs: Dict[str, List[dict]] = {k: [] for k in variants}
        trl: List[dict] = []
        trl_lora: List[dict] = []
        lora_lr = args.lora_lr if args.lora_lr is not None else case.lr
        lora_case = dataclasses.replace(case, lora_rank=args.lora, lora_alpha=2.0 * args.lora, lr=lora_lr)
        for rep in range(args.repeats):
            for name, overrides in variants.items():
                overrides = [o.replace("{lr}", str(lora_lr)) for o in overrides]
                if "ballast" in systems:
                    try:
                        peak = matmul_peak_flops(1) * args.workers
                        r = run_ballast(case, args.warmup, steps, args.workers, overrides, args.log_dir,
                                        args.tail_steps, args.threads_per_worker)
                        r["peak_flops_total"] = peak
                    except RuntimeError as err:  # e.g. killed by a memory-starved shared machine
                        print(f"[{case.name}] ballast/{name} rep {rep} FAILED: {err}", flush=True)
                        result.setdefault("failed_runs", []).append(f"{case.name}/{name}/{rep}: {err}")
                        continue
                    runs[name].append(r)
                    print(f"[{case.name}] ballast/{name} rep {rep}: {r['s_per_step']:.3f} s/step "
                          f"{json.dumps({k: round(v, 3) for k, v in r['phases'].items()})}", flush=True)
            if "trl" in systems:
                try:
                    peak = matmul_peak_flops(1) * args.workers
                    trl.append(run_trl(case, args.warmup, steps, args.trl_threads or args.workers, args.log_dir))
                    trl[-1]["peak_flops_total"] = peak
                    print(f"[{case.name}] trl rep {rep}: {trl[-1]['s_per_step']:.3f} s/step", flush=True)
                except RuntimeError as err:
                    print(f"[{case.name}] trl rep {rep} FAILED: {err}", flush=True)
                    result.setdefault("failed_runs", []).append(f"{case.name}/trl/{rep}: {err}")
            if args.lora and ("trl" in systems or "trl_lora" in systems):
                try:
                    trl_lora.append(run_trl(lora_case, args.warmup, steps, args.trl_threads or args.workers,
                                            args.log_dir))
                    print(f"[{case.name}] trl_lora rep {rep}: {trl_lora[-1]['s_per_step']:.3f} s/step", flush=True)
                except RuntimeError as err:
                    print(f"[{case.name}] trl_lora rep {rep} FAILED: {err}", flush=True)
                    result.setdefault("failed_runs", []).append(f"{case.name}/trl_lora/{rep}: {err}")
        runs = {k: v for k, v in runs.items() if v}
        if "ballast" in systems and runs:
            summary = summarise(case, runs, trl, peak_total, trl_lora)
        elif trl:
            s = statistics.median(r["s_per_step"] for r in trl)
            summary = {"name": case.name, "ballast_s_per_step": None, "trl_s_per_step": s, "ratio_vs_trl": None,
                       "phases": None, "mfu_update": None, "trl_runs": trl}
        else:
            continue
        result["cases"].append(summary)
        print(json.dumps({k: summary.get(k) for k in ("name", "ballast_s_per_step", "trl_s_per_step", "ratio_vs_trl",
                                                       "ratio_vs_trl_paired", "ballast_whole_run_s_per_step",
                                                       "trl_whole_run_s_per_step", "whole_run_ratio_vs_trl",
                                                       "ballast_response_length_mean", "trl_response_length_mean",
                                                       "phases", "mfu_update", "hfu_update", "mfu_log_prob", "floor_s",
                                                       "lora")}, indent=1), flush=True)
    result["load_avg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
