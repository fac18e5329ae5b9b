"""Recovery from worker deaths: a run killed (`kill -9` on one worker) every K steps and resumed with
`trainer.resume_mode=auto` by a wrapper loop, against the same run left alone.

Both runs use the tiny cached model and the synthetic repeat task on 2 CPU workers (the e2e tests'
fast GRPO configuration, HF rollouts). The faulty run is relaunched after every kill until it exits 0.
Reported (JSON with --json): for every kill, the step the run had logged and the checkpoint it resumed
from (steps redone = the difference), every launch's wall time, the total wall time of both runs
(time lost = the difference), and whether the last step's metrics of both runs are equal.

    python benchmarks/recovery_bench.py --steps 200 --kill-every 50 --save-freq 10 --json

Timings depend on the machine's load; a run of this on a shared machine says little about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


def _args(model, train, val, run_dir, steps, save_freq):
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
        f"trainer.default_local_dir={run_dir}", "data.max_prompt_length=32", "data.max_response_length=24",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=grpo",
        "trainer.device=cpu", "trainer.n_gpus_per_node=2", "trainer.logger=[jsonl]", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.resume_mode=auto", f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={save_freq}", "trainer.worker_timeout_s=300", "ray_init.num_cpus=2",
    ]


def _launch(args, log):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "ballast.trainer.main", *args], env=env, cwd=str(REPO),
                            stdout=log, stderr=subprocess.STDOUT)


def _rows(run_dir):
    path = Path(run_dir, "metrics.jsonl")
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def _run(args, run_dir, kill_at, log):
    """Launch until exit 0, killing worker rank 1 when the logged step first reaches each of `kill_at`."""
    launches, kills, pending = [], [], list(kill_at)
    start = time.monotonic()
    while True:
        began = time.monotonic()
        proc = _launch(args, log)
        killed = None
        while proc.poll() is None:
            rows = _rows(run_dir)
            if pending and rows and rows[-1]["step"] >= pending[0] and killed is None:
                victim = json.load(open(os.path.join(run_dir, "workers.json")))[1]
                os.kill(victim["pid"], signal.SIGKILL)
                marker = Path(run_dir, "latest_checkpointed_iteration.txt")
                killed = {"logged_step": rows[-1]["step"], "checkpoint_step": int(marker.read_text())
                          if marker.is_file() else 0, "at_s": round(time.monotonic() - start, 1)}
                pending.pop(0)
            time.sleep(0.2)
        launches.append({"seconds": round(time.monotonic() - began, 1), "exit_code": proc.returncode})
        if killed is not None:
            killed["exit_code"] = proc.returncode
            killed["steps_redone"] = killed["logged_step"] - killed["checkpoint_step"]
            kills.append(killed)
        if proc.returncode == 0:
            return {"wall_s": round(time.monotonic() - start, 1), "launches": launches, "kills": kills,
                    "last": _rows(run_dir)[-1]}
        if killed is None or len(launches) > len(kill_at) + 3:
            raise RuntimeError(f"run failed without a kill (exit {proc.returncode}); see the log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-every", type=int, default=50)
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--workdir", default=None, help="where run directories and logs go (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from ballast.data import write_repeat_dataset
    from ballast.models import tiny_model_dir

    work = Path(opts.workdir or tempfile.mkdtemp(prefix="recovery_"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_repeat_dataset(str(work / "data"), train_size=64, val_size=8, seed=0, k_median=6, k_max=20)
    model = str(tiny_model_dir())
    kill_at = list(range(opts.kill_every, opts.steps, opts.kill_every))
    result = {"steps": opts.steps, "kill_every": opts.kill_every, "save_freq": opts.save_freq, "workdir": str(work)}
    for name, kills in (("faulty", kill_at), ("reference", [])):
        run_dir = str(work / name)
        with open(work / f"{name}.log", "w") as log:
            result[name] = _run(_args(model, data["train"], data["val"], run_dir, opts.steps, opts.save_freq),
                                run_dir, kills, log)
    last_f, last_r = result["faulty"].pop("last"), result["reference"].pop("last")
    result["final_metrics"] = {k: [last_f.get(k), last_r.get(k)] for k in COMPARED}
    result["final_metrics_equal"] = all(last_f.get(k) == last_r.get(k) for k in COMPARED)
    result["steps_redone"] = sum(k["steps_redone"] for k in result["faulty"]["kills"])
    result["wall_s_lost"] = round(result["faulty"]["wall_s"] - result["reference"]["wall_s"], 1)
    print(json.dumps(result, indent=None if opts.json else 1))


if __name__ == "__main__":
    main()
