#!/usr/bin/env bash
# The GPU smoke check: one script a CUDA machine runs, ending in a summary table. Warm, phases 1-2 take a
# few minutes and each run of phase 3 about as long as phase 2 (the runs of phase 3 are not yet timed on
# a GPU); a cold machine also pays the vLLM import, engine start-up (kernel loading, memory
# profiling), NCCL communicator set-up and Ray start, so each phase has a generous time limit:
#   BALLAST_SMOKE_PYTEST_S (default 300), BALLAST_SMOKE_GRPO_S (300), BALLAST_SMOKE_RUN_S (300, each run
#   of phase 3), BALLAST_SMOKE_BENCH_S (120).
#
#   bash scripts/gpu_smoke.sh            # in the Docker image, or after scripts/setup.sh on a GPU box
#   bash scripts/gpu_smoke.sh --setup    # run scripts/setup.sh first (not counted in the 5 minutes)
#
# 1. gpu-marked tests   pytest -m gpu (NCCL engine + bf16 + flash-attn, CUDA vLLM sleep/sync/wake); the
#                       whole tests/ tree is collected, and modules whose reference packages are absent
#                       (the verl parity tests: the image does not install verl) skip instead of erroring
# 2. GRPO on the GPU    3 steps of the tiny model: trainer.device=cuda, CUDA vLLM rollouts with log-probs,
#                       NCCL between min(2, #GPUs) workers (its log lines are the workers', in the run's
#                       logs/ folder); metrics must be finite and vLLM must agree with the FSDP actor on
#                       the sampled tokens
# 3. more runs         3 GRPO steps each on phase 2's data (and model, but for the agent), metrics finite:
#                       - LoRA: a rank-8 adapter synced adapter-only into the sleeping vLLM engine, the
#                         weight-sync check passing after every sync
#                       - split pools (2+ GPUs): a rollout pool of its own, weights through the object store
#                       - async tool agent (2+ GPUs): tool_agent conversations on split pools with
#                         partial rollouts (verl's separate_async with a window), from the tiny model
#                         rewired to call the calculator on every turn (random models call no tool); the
#                         calculator answers after 2 s, so the trainer's update lands while requests are
#                         in flight, which resume under the new weights (at least one must)
#                       - rollout TP=2 (2+ GPUs): one vLLM engine over two colocated workers
#                       On one GPU the 2-GPU runs are reported as SKIP.
# 4. engine benchmark   benchmarks/engine_bench.py --device cuda --json (when present): the update
#                       throughput of static vs dynamic micro-batches on this GPU
# Exit code: 0 when every step passed, 1 when one failed, 2 when there is no usable GPU (it never
# pretends to pass on a CPU machine). Outputs land in $BALLAST_SMOKE_DIR (default .cache/gpu_smoke).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
die() { printf 'gpu_smoke.sh: %s\n' "$*" >&2; exit 2; }

SETUP=0
for arg in "$@"; do
  case "$arg" in
    --setup) SETUP=1 ;;
    *) die "unknown argument '$arg' (expected --setup)" ;;
  esac
done

# --- refuse to run without a GPU -----------------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: this script needs an NVIDIA GPU machine (driver installed)"
GPU_LIST="$(nvidia-smi -L 2>&1)" || die "nvidia-smi failed, no usable GPU: $GPU_LIST"
NUM_GPUS="$(grep -c '^GPU ' <<<"$GPU_LIST")"
[[ "$NUM_GPUS" -ge 1 ]] || die "nvidia-smi lists no GPU: $GPU_LIST"
if [[ $SETUP -eq 1 ]]; then bash scripts/setup.sh || die "scripts/setup.sh failed"; fi
if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python || command -v python3)"; fi
[[ -n "$PY" ]] || die "no python: run with --setup, or inside the Docker image"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || die "torch in $PY sees no CUDA device (CPU build installed? run with --setup)"

OUT="${BALLAST_SMOKE_DIR:-$ROOT/.cache/gpu_smoke}"
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0 VLLM_NO_USAGE_STATS=1 WANDB_MODE=disabled
export BALLAST_CACHE_DIR="${BALLAST_CACHE_DIR:-$ROOT/.cache}" NCCL_DEBUG="${NCCL_DEBUG:-INFO}"
WORKERS=$(( NUM_GPUS >= 2 ? 2 : 1 ))
PYTEST_S="${BALLAST_SMOKE_PYTEST_S:-300}" GRPO_S="${BALLAST_SMOKE_GRPO_S:-300}" BENCH_S="${BALLAST_SMOKE_BENCH_S:-120}"
RUN_S="${BALLAST_SMOKE_RUN_S:-300}"
# The tiny model's KV cache: 64 MiB is thousands of blocks for it. Left to gpu_memory_utilization,
# 0.3 of a 141 GB GPU would be millions of blocks (slow to allocate and to manage, for nothing).
KV_BYTES=$(( 64 << 20 ))
echo "[gpu_smoke] $NUM_GPUS GPU(s): $(head -1 <<<"$GPU_LIST"); python $PY; outputs in $OUT"

NAMES=(); RESULTS=(); SECONDS_TAKEN=(); NOTES=()
record() { NAMES+=("$1"); RESULTS+=("$2"); SECONDS_TAKEN+=("$3"); NOTES+=("$4"); }

# --- 1. gpu-marked tests -------------------------------------------------------------------------
start=$SECONDS
timeout "$PYTEST_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider tests >"$OUT/pytest_gpu.log" 2>&1
rc=$?
tail -3 "$OUT/pytest_gpu.log"
summary="$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_gpu.log" | tail -1)"
# Every gpu test skipping (no flash-attn, no vllm) is not a pass on a GPU machine.
if [[ $rc -eq 0 ]] && ! grep -q ' passed' <<<"$summary"; then rc=1; summary="no gpu test ran: $summary"; fi
record "pytest -m gpu" "$([[ $rc -eq 0 ]] && echo PASS || echo "FAIL($rc)")" $((SECONDS - start)) "$summary"

# --- 2. a few GRPO steps with CUDA vLLM and NCCL ---------------------------------------------------
start=$SECONDS
RUN="$OUT/grpo"
{
  "$PY" -m ballast.models --out "$OUT/model" --preset tiny --seed 0 &&
  "$PY" examples/data/make_synthetic.py --out "$OUT/data" --train-size 64 --val-size 8 &&
  timeout "$GRPO_S" "$PY" -m ballast.trainer.main \
    "actor_rollout_ref.model.path=$OUT/model" "data.train_files=$OUT/data/train.parquet" \
    "trainer.default_local_dir=$RUN" trainer.device=cuda "trainer.n_gpus_per_node=$WORKERS" \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
    "actor_rollout_ref.rollout.kv_cache_memory_bytes=$KV_BYTES" \
    actor_rollout_ref.rollout.calculate_log_probs=True algorithm.adv_estimator=grpo \
    data.train_batch_size=8 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    data.max_prompt_length=64 data.max_response_length=32 actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024 actor_rollout_ref.actor.optim.lr=1e-3 \
    trainer.total_training_steps=3 trainer.save_freq=-1 trainer.test_freq=-1 trainer.val_before_train=false \
    trainer.resume_mode=disable 'trainer.logger=[jsonl]' "trainer.worker_timeout_s=$GRPO_S"
} >"$OUT/grpo.log" 2>&1
rc=$?
tail -3 "$OUT/grpo.log"
if [[ $rc -eq 0 ]]; then
  note="$("$PY" - "$RUN/metrics.jsonl" <<'PY' 2>&1
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 2, 3], f"steps {[r['step'] for r in rows]}"
keys = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "training/rollout_actor_log_prob_diff/max"]
bad = {k: r.get(k) for r in rows for k in keys if not isinstance(r.get(k), float) or not math.isfinite(r[k])}
assert not bad, f"missing or non-finite: {bad}"
diff = rows[-1]["training/rollout_actor_log_prob_diff/max"]
# bf16 vLLM vs the bf16-compute FSDP actor on the same weights: bf16 noise, not zero. A missing weight
# sync gave 0.87 after two lr=1e-3 updates on CPU (tests/e2e), so 0.3 is a coarse sync check.
assert diff < 0.3, f"vLLM and the actor disagree after weight sync: max |log-prob diff| {diff:.3g}"
print(f"3 steps, {rows[-1]['timing_s/step']:.2f} s/step, vllm-actor max log-prob diff {diff:.2g}")
PY
)" || rc=1
  note="${note##*$'\n'}"
else
  note="$(grep '^ballast: ' "$OUT/grpo.log" | tail -1)"
  [[ -n "$note" ]] || note="$(tail -1 "$OUT/grpo.log")"
fi
# NCCL logs in the worker processes, whose output goes to the run's logs/ folder (the driver's log
# holds it only with BALLAST_VERBOSE=1, which streams worker output to the terminal).
if [[ $WORKERS -ge 2 ]] && ! grep -rqs "NCCL INFO" "$OUT/grpo.log" "$RUN/logs"; then
  rc=1; note="no NCCL log lines with 2 workers (in grpo.log or $RUN/logs/); $note"
fi
record "GRPO cuda+vllm+nccl x$WORKERS" "$([[ $rc -eq 0 ]] && echo PASS || echo "FAIL($rc)")" $((SECONDS - start)) "$note"

# --- 3. LoRA, split pools, an async agent with interrupted requests, rollout TP ----------------------
# Phase 2's settings without its run directory and worker count; each run adds its own.
COMMON=(
  "actor_rollout_ref.model.path=$OUT/model" "data.train_files=$OUT/data/train.parquet" trainer.device=cuda
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.3
  "actor_rollout_ref.rollout.kv_cache_memory_bytes=$KV_BYTES"
  actor_rollout_ref.rollout.calculate_log_probs=True algorithm.adv_estimator=grpo
  data.train_batch_size=8 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4
  data.max_prompt_length=64 data.max_response_length=32 actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024 actor_rollout_ref.actor.optim.lr=1e-3
  trainer.total_training_steps=3 trainer.save_freq=-1 trainer.test_freq=-1 trainer.val_before_train=false
  trainer.resume_mode=disable 'trainer.logger=[jsonl]' "trainer.worker_timeout_s=$RUN_S"
)
LORA_RUN=("trainer.n_gpus_per_node=$WORKERS" actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=16
  actor_rollout_ref.actor.optim.lr=2e-2)
# one local update per step, on the whole batch (parameter_sync_step x ppo_mini_batch_size = train_batch_size)
SPLIT_POOLS=(trainer.v1.trainer_mode=separate_async actor_rollout_ref.hybrid_engine=False trainer.n_gpus_per_node=1
  actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1
  trainer.v1.separate_async.parameter_sync_step=1 actor_rollout_ref.actor.ppo_mini_batch_size=8)
SPLIT_RUN=("${SPLIT_POOLS[@]}" trainer.v1.separate_async.num_warmup_batches=0)
# testkit.agent (tests/ on PYTHONPATH, which the workers inherit): the tool-calling model (built below,
# before the run) and the calculator answering after delay_s; three sampled turns around two calls make
# each conversation last >= 4 s. Partial rollouts are on by default here (verl's meaning of the mode).
TOOL_MODEL="$OUT/tool_model"
ASYNC_RUN=("${SPLIT_POOLS[@]}" trainer.v1.separate_async.num_warmup_batches=1 actor_rollout_ref.rollout.mode=async
  "actor_rollout_ref.model.path=$TOOL_MODEL" actor_rollout_ref.rollout.multi_turn.enable=True
  actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
  "actor_rollout_ref.rollout.multi_turn.tool_config_path=$OUT/tools.yaml"
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 data.max_response_length=96)
TP_RUN=(trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2)
printf 'tools:\n  - class_name: testkit.agent.SlowCalculatorTool\n    config: {type: native, timeout_s: 30, delay_s: 2}\n' \
  >"$OUT/tools.yaml"

smoke_run() {  # smoke_run NAME KIND GPUS OVERRIDES...: 3 steps with COMMON + OVERRIDES, then KIND's metric checks
  local name="$1" kind="$2" gpus="$3" run="$OUT/$2" start=$SECONDS rc note
  shift 3
  if [[ $NUM_GPUS -lt $gpus ]]; then record "$name" SKIP 0 "needs $gpus GPUs, this machine has $NUM_GPUS"; return; fi
  PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" timeout "$RUN_S" "$PY" -m ballast.trainer.main "${COMMON[@]}" \
    "trainer.default_local_dir=$run" "$@" >"$OUT/$kind.log" 2>&1
  rc=$?
  tail -2 "$OUT/$kind.log"
  if [[ $rc -eq 0 ]]; then
    note="$("$PY" - "$run/metrics.jsonl" "$kind" "$OUT/$kind.log" <<'PY' 2>&1
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
kind, log = sys.argv[2], open(sys.argv[3]).read()
assert [r["step"] for r in rows] == [1, 2, 3], f"steps {[r['step'] for r in rows]}"
need = {"lora": ["rollout/sync_check/mean_abs_diff", "rollout/sync_check/tolerance", "rollout/sync_check/adapter_effect"],
        "split": ["timing_s/export_weights"], "async": ["rollout/partial/weight_loads", "agent/tool_calls/total"],
        "tp": []}[kind]
keys = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "training/rollout_actor_log_prob_diff/max"]
bad = {k: r.get(k) for r in rows for k in keys if not isinstance(r.get(k), float) or not math.isfinite(r[k])}
bad.update({k: None for k in need if not any(isinstance(r.get(k), float) and math.isfinite(r[k]) for r in rows)})
assert not bad, f"missing or non-finite: {bad}"
checked = [r["rollout/sync_check/mean_abs_diff"] for r in rows if "rollout/sync_check/mean_abs_diff" in r]
if kind == "lora":  # adapter-only sync into the sleeping engine (not merged weights), checked after every sync
    assert "LoRA weight sync: adapter only" in log, "the adapter was not synced on its own"
    assert len(checked) == 3 and rows[-1]["rollout/sync_check/adapter_effect"] > 0, checked
if kind == "split":
    assert len(checked) >= 2, f"weight-sync checks on the rollout pool: {checked}"
if kind == "async":  # a request interrupted by new weights resumes under them: two weight versions in it
    spans = [r.get("training/off_policy/trajectory_spans/max", 0) for r in rows]
    assert max(spans) == 2 and max(r["rollout/partial/weight_loads"] for r in rows) >= 1, spans
    calls, failed = (sum(r.get(f"agent/{k}/total", 0) for r in rows) for k in ("tool_calls", "tool_errors"))
    assert calls > 0 and failed == 0, f"tool calls {calls}, tool errors {failed}"  # the tool ran, and answered
diff = rows[-1]["training/rollout_actor_log_prob_diff/max"]
# as phase 2's bound; not for partial rollouts, whose tokens are up to one update older than the actor
assert kind == "async" or diff < 0.3, f"vLLM and the actor disagree after weight sync: max |log-prob diff| {diff:.3g}"
print(f"3 steps, {rows[-1]['timing_s/step']:.2f} s/step, {len(checked)} sync checks, max log-prob diff {diff:.2g}")
PY
)" || rc=1
    note="${note##*$'\n'}"
  else
    note="$(grep '^ballast: ' "$OUT/$kind.log" | tail -1)"
    [[ -n "$note" ]] || note="$(tail -1 "$OUT/$kind.log")"
  fi
  record "$name" "$([[ $rc -eq 0 ]] && echo PASS || echo "FAIL($rc)")" $((SECONDS - start)) "$note"
}
smoke_run "LoRA GRPO x$WORKERS" lora 1 "${LORA_RUN[@]}"
smoke_run "split pools 1+1" split 2 "${SPLIT_RUN[@]}"
if [[ $NUM_GPUS -ge 2 ]]; then  # a failed build leaves no model: the run after it fails, naming the path
  PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    'import sys; from testkit.agent import build_tool_calling_model as build; build(sys.argv[1])' "$TOOL_MODEL" \
    >"$OUT/tool_model.log" 2>&1
fi
smoke_run "async tool agent, partial rollouts" async 2 "${ASYNC_RUN[@]}"
smoke_run "rollout TP=2" tp 2 "${TP_RUN[@]}"

# --- 4. engine benchmark ---------------------------------------------------------------------------
start=$SECONDS
if [[ -f benchmarks/engine_bench.py ]]; then
  timeout "$BENCH_S" "$PY" benchmarks/engine_bench.py --device cuda --json "$OUT/engine_bench.json" >"$OUT/engine_bench.log" 2>&1
  rc=$?
  note="$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if 'tokens_per_s' in k or 'speedup' in k or k == 'device'})" "$OUT/engine_bench.json" 2>/dev/null || tail -1 "$OUT/engine_bench.log")"
  record "engine_bench" "$([[ $rc -eq 0 ]] && echo PASS || echo "FAIL($rc)")" $((SECONDS - start)) "$note"
else
  record "engine_bench" "SKIP" 0 "benchmarks/engine_bench.py not present"
fi

# --- summary ------------------------------------------------------------------------------------------
echo
printf '%-32s %-9s %6s  %s\n' "check" "result" "secs" "notes"
failed=0
for i in "${!NAMES[@]}"; do
  printf '%-32s %-9s %6s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${NOTES[$i]:0:160}"
  [[ "${RESULTS[$i]}" == FAIL* ]] && failed=1
done
echo "[gpu_smoke] total ${SECONDS}s; logs in $OUT"
exit $failed
