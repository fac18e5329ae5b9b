#!/usr/bin/env bash
# Submit a GRPO run to a running Ray cluster with `ray job submit` (see docs/multinode.md).
#
#   MODEL=/shared/models/my-hf-model TRAIN_FILES=/shared/data/gsm8k/train.parquet \
#   VAL_FILES=/shared/data/gsm8k/test.parquet NNODES=2 GPUS_PER_NODE=8 \
#   bash examples/ray_job_grpo.sh [extra hydra overrides]
#
# The job's driver runs on the head node and joins the cluster with ray_init.address=auto; its
# workers run on every node, so MODEL, the data files and RUN_DIR (checkpoints: each worker writes
# its own shard) must be on a filesystem every node sees, and Ballast must be installed on every
# node (the Docker image, or scripts/setup.sh). Variables:
#   RAY_DASHBOARD    the head's job API (http://127.0.0.1:8265: run this on the head, or through
#                    `ssh -L 8265:127.0.0.1:8265 head`)
#   NNODES, GPUS_PER_NODE   trainer.nnodes and trainer.n_gpus_per_node (world size = their product)
#   RUN_DIR          trainer.default_local_dir (default: $PWD/checkpoints/ray_job_grpo)
#   BALLAST_PYTHON   the Python that runs the driver on the head (default: python)
#   NO_WAIT=1        return once the job is submitted; follow it with `ray job logs -f <id>`
# Extra arguments are hydra overrides and win over the ones below. `ray job submit` waits for the job
# and exits non-zero when it fails (NO_WAIT=1 aside).
set -euo pipefail
: "${MODEL:?set MODEL to a local Hugging Face model directory present on every node}"
: "${TRAIN_FILES:?set TRAIN_FILES to the training parquet/jsonl file(s) present on every node}"
DASHBOARD="${RAY_DASHBOARD:-http://127.0.0.1:8265}"
NNODES="${NNODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RUN_DIR="${RUN_DIR:-$PWD/checkpoints/ray_job_grpo}"
PY="${BALLAST_PYTHON:-python}"
RAY="${BALLAST_RAY_BIN:-ray}"
SUBMISSION_ID="${SUBMISSION_ID:-ballast-grpo-$(date +%Y%m%d-%H%M%S)-$$}"

OVERRIDES=(
  "actor_rollout_ref.model.path=$MODEL"
  "data.train_files=$TRAIN_FILES"
  "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$GPUS_PER_NODE"
  "ray_init.address=auto"
  "trainer.default_local_dir=$RUN_DIR" "trainer.resume_mode=auto"
  "algorithm.adv_estimator=grpo" "actor_rollout_ref.rollout.n=4"
  "data.train_batch_size=${TRAIN_BATCH_SIZE:-64}" "actor_rollout_ref.actor.ppo_mini_batch_size=${MINI_BATCH_SIZE:-32}"
  "actor_rollout_ref.actor.use_dynamic_bsz=True" "trainer.balance_batch=True"
  "trainer.logger=[console,jsonl]"
)
[[ -n "${VAL_FILES:-}" ]] && OVERRIDES+=("data.val_files=$VAL_FILES")

ARGS=(job submit "--address=$DASHBOARD" "--submission-id=$SUBMISSION_ID")
[[ "${NO_WAIT:-0}" == 1 ]] && ARGS+=(--no-wait)
echo "[ray_job_grpo] submitting $SUBMISSION_ID to $DASHBOARD: ${NNODES} node(s) x ${GPUS_PER_NODE} device(s)"
exec "$RAY" "${ARGS[@]}" -- "$PY" -m ballast.trainer.main "${OVERRIDES[@]}" "$@"
