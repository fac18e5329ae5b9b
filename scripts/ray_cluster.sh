#!/usr/bin/env bash
# Start (or stop) one node of a Ray cluster for Ballast: the head, or a worker that joins it.
#
#   scripts/ray_cluster.sh head   [options]                      # on the first machine
#   scripts/ray_cluster.sh worker --address HEAD_IP:6379 [options] # on every other machine
#   scripts/ray_cluster.sh status [--address HEAD_IP:6379]
#   scripts/ray_cluster.sh stop                                  # `ray stop`: every Ray process of this user here
#
# Options (environment variable in brackets; a flag wins over the variable):
#   --ip IP                IP this node advertises to the others [BALLAST_RAY_IP]. Default: Ray's choice,
#                          the address of the default route. Ray never advertises loopback on Linux: give
#                          127.0.0.1 and it still uses the machine's address (its gRPC ports listen on every
#                          interface), so keep the cluster on a trusted network and token auth on.
#   --port PORT            head only: GCS port [BALLAST_RAY_PORT] (6379)
#   --address HOST:PORT    worker only: the head's GCS address [BALLAST_RAY_ADDRESS]
#   --num-cpus N           CPUs this node offers [BALLAST_RAY_NUM_CPUS]. Ballast takes 1 per worker process.
#   --num-gpus N           GPUs this node offers [BALLAST_RAY_NUM_GPUS] (default: all visible)
#   --resources JSON       extra custom resources, e.g. '{"big_mem": 1}'
#   --dashboard-host HOST  head only: where the dashboard and job API listen [BALLAST_RAY_DASHBOARD_HOST]
#                          (127.0.0.1: reachable from this machine or through an SSH tunnel only)
#   --dashboard-port PORT  head only (8265)
#   --no-dashboard         head only: no dashboard (then `ray job submit` is unavailable)
#   --auth token|disabled  Ray token authentication [RAY_AUTH_MODE] (token). The head creates a token in
#                          ~/.ray/auth_token (mode 600) if none exists; every other node and every driver needs the
#                          same token (copy the file, or export RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH).
#   --temp-dir DIR         head only: Ray's session/log directory (Ray's default /tmp/ray)
#   --wait-s S             worker only: wait up to S seconds for the head to answer before joining (60)
#   --block                stay in the foreground; SIGTERM or Ctrl-C stops this node's Ray processes
#                          (what a job scheduler or a container entrypoint wants)
# Anything after `--` goes to `ray start` unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { printf 'ray_cluster.sh: %s\n' "$*" >&2; exit 2; }
say() { printf '[ray_cluster] %s\n' "$*"; }

find_ray() {
  if [[ -n "${BALLAST_RAY_BIN:-}" ]]; then echo "$BALLAST_RAY_BIN"
  elif command -v ray >/dev/null 2>&1; then command -v ray
  elif [[ -x "$ROOT/.venv/bin/ray" ]]; then echo "$ROOT/.venv/bin/ray"
  else die "no 'ray' command: activate the environment (source .venv/bin/activate) or set BALLAST_RAY_BIN"
  fi
}

# True when something accepts TCP connections at $1:$2 (bash's /dev/tcp, no extra tools needed).
answers() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

ROLE="${1:-}"
[[ -n "$ROLE" ]] || die "usage: $0 head|worker|status|stop [options]  (see the header of this script)"
shift
IP="${BALLAST_RAY_IP:-}"; PORT="${BALLAST_RAY_PORT:-6379}"; ADDRESS="${BALLAST_RAY_ADDRESS:-}"
NUM_CPUS="${BALLAST_RAY_NUM_CPUS:-}"; NUM_GPUS="${BALLAST_RAY_NUM_GPUS:-}"; RESOURCES=""
DASH_HOST="${BALLAST_RAY_DASHBOARD_HOST:-127.0.0.1}"; DASH_PORT=8265; DASHBOARD=1
AUTH="${RAY_AUTH_MODE:-token}"; TEMP_DIR=""; WAIT_S=60; BLOCK=0; EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ip) IP="${2:?--ip needs a value}"; shift 2 ;;
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --address) ADDRESS="${2:?--address needs a value}"; shift 2 ;;
    --num-cpus) NUM_CPUS="${2:?--num-cpus needs a value}"; shift 2 ;;
    --num-gpus) NUM_GPUS="${2:?--num-gpus needs a value}"; shift 2 ;;
    --resources) RESOURCES="${2:?--resources needs a value}"; shift 2 ;;
    --dashboard-host) DASH_HOST="${2:?--dashboard-host needs a value}"; shift 2 ;;
    --dashboard-port) DASH_PORT="${2:?--dashboard-port needs a value}"; shift 2 ;;
    --no-dashboard) DASHBOARD=0; shift ;;
    --auth) AUTH="${2:?--auth needs token or disabled}"; shift 2 ;;
    --temp-dir) TEMP_DIR="${2:?--temp-dir needs a value}"; shift 2 ;;
    --wait-s) WAIT_S="${2:?--wait-s needs a value}"; shift 2 ;;
    --block) BLOCK=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option '$1' for '$ROLE' (see the header of $0)" ;;
  esac
done
for pair in "port:$PORT" "dashboard-port:$DASH_PORT" "wait-s:$WAIT_S"; do
  [[ "${pair#*:}" =~ ^[0-9]+$ ]] || die "--${pair%%:*} must be a whole number, got '${pair#*:}'"
done
[[ -z "$NUM_CPUS" || "$NUM_CPUS" =~ ^[0-9]+$ ]] || die "--num-cpus must be a whole number, got '$NUM_CPUS'"
[[ -z "$NUM_GPUS" || "$NUM_GPUS" =~ ^[0-9]+$ ]] || die "--num-gpus must be a whole number, got '$NUM_GPUS'"
case "$AUTH" in token|disabled) ;; *) die "--auth must be 'token' or 'disabled', got '$AUTH'" ;; esac
RAY="$(find_ray)"
export RAY_AUTH_MODE="$AUTH" RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"

# Arguments every node shares.
node_args() {
  ARGS=()
  [[ -n "$IP" ]] && ARGS+=("--node-ip-address=$IP")
  [[ -n "$NUM_CPUS" ]] && ARGS+=("--num-cpus=$NUM_CPUS")
  [[ -n "$NUM_GPUS" ]] && ARGS+=("--num-gpus=$NUM_GPUS")
  [[ -n "$RESOURCES" ]] && ARGS+=("--resources=$RESOURCES")
  [[ $BLOCK -eq 1 ]] && ARGS+=("--block")
  ARGS+=("--disable-usage-stats")
  return 0
}

have_token() {
  [[ -n "${RAY_AUTH_TOKEN:-}" ]] || [[ -n "${RAY_AUTH_TOKEN_PATH:-}" && -s "${RAY_AUTH_TOKEN_PATH}" ]] \
    || [[ -s "$HOME/.ray/auth_token" ]]
}

case "$ROLE" in
  head)
    [[ -z "$ADDRESS" ]] || die "--address is for 'worker'; the head listens on --port"
    node_args
    ARGS=(start --head "--port=$PORT" "${ARGS[@]}")
    if [[ $DASHBOARD -eq 1 ]]; then
      ARGS+=(--include-dashboard=true "--dashboard-host=$DASH_HOST" "--dashboard-port=$DASH_PORT")
    else
      ARGS+=(--include-dashboard=false)
    fi
    [[ -n "$TEMP_DIR" ]] && ARGS+=("--temp-dir=$TEMP_DIR")
    if [[ "$AUTH" == token ]] && ! have_token; then
      say "creating a Ray auth token in ~/.ray/auth_token, readable by you only (copy it to every node and driver)"
      (umask 077 && "$RAY" get-auth-token --generate >/dev/null)  # Ray itself writes it world-readable
    fi
    if [[ "$AUTH" == token && -f "$HOME/.ray/auth_token" ]]; then
      chmod 600 "$HOME/.ray/auth_token"  # also one made earlier by Ray, or by `ray start` on its own
    fi
    say "head: GCS port $PORT, dashboard $([[ $DASHBOARD -eq 1 ]] && echo "http://$DASH_HOST:$DASH_PORT" || echo off), auth $AUTH"
    [[ "$DASH_HOST" == 127.0.0.1 || "$DASH_HOST" == localhost || $DASHBOARD -eq 0 ]] \
      || say "WARNING: the dashboard and job API listen on $DASH_HOST: anyone reaching it can run code on the cluster"
    exec "$RAY" "${ARGS[@]}" "${EXTRA[@]}"
    ;;
  worker)
    [[ -n "$ADDRESS" ]] || die "worker needs --address HEAD_IP:PORT (or BALLAST_RAY_ADDRESS)"
    [[ "$ADDRESS" =~ ^(.+):([0-9]+)$ ]] || die "--address must be HOST:PORT, got '$ADDRESS'"
    HEAD_HOST="${BASH_REMATCH[1]}"; HEAD_PORT="${BASH_REMATCH[2]}"
    [[ $DASHBOARD -eq 1 && "$DASH_HOST" == 127.0.0.1 ]] || say "dashboard options are ignored on a worker"
    [[ -z "$TEMP_DIR" ]] || say "--temp-dir is ignored on a worker (it uses the head's session layout)"
    if [[ "$AUTH" == token ]] && ! have_token; then
      die "auth is token but no token here: copy the head's ~/.ray/auth_token, or export RAY_AUTH_TOKEN"
    fi
    deadline=$((SECONDS + WAIT_S))
    until answers "$HEAD_HOST" "$HEAD_PORT"; do
      (( SECONDS < deadline )) || die "the head did not answer at $ADDRESS within ${WAIT_S}s (--wait-s)"
      sleep 1
    done
    node_args
    say "worker: joining $ADDRESS, auth $AUTH"
    exec "$RAY" start "--address=$ADDRESS" "${ARGS[@]}" "${EXTRA[@]}"
    ;;
  status)
    exec "$RAY" status ${ADDRESS:+"--address=$ADDRESS"} "${EXTRA[@]}"
    ;;
  stop)
    exec "$RAY" stop "${EXTRA[@]}"
    ;;
  *) die "unknown role '$ROLE': expected head, worker, status or stop" ;;
esac
