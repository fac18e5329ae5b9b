"""Command-line entry point: `python -m ballast.trainer.main [hydra overrides]` (or `ballast-train`).

Hydra composes `configs/ppo_trainer.yaml` (or `--config-name quickstart`) with verl-style overrides.
Before Ray starts, the run directory is checked (a busy or occupied one is refused before anything
is read), then `prepare_typed` takes the frozen typed config, reads the model's config, the data and
the reward function, and plans the run (`plan_run`: the start-up check, which builds the
derived sizes and every worker spec once); `training_session` then starts Ray and constructs the
workers from that plan. `--cfg job` prints the composed config without running.

A failed run ends with one line on stderr saying why and an exit code a scheduler can act on:
0 done, 2 bad config, input or environment (config, data, model files, tokenizer, reward function,
a run directory that is unusable, in use or holding another run, a damaged checkpoint, a full disk),
3 a worker died, timed out or raised, 4 a guard of the training loop stopped it (too many non-finite
steps in a row, dynamic sampling that cannot fill a batch), 5 the Ray cluster did not answer or could
not place the workers, or a local Ray did not start, 130 Ctrl-C, 143 SIGTERM, 1 anything else (with
its traceback). Once a run is stopping, further signals cannot cut its cleanup short (see
`ballast.trainer.run.signals`); docs/reliability.md lists what each case looks like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from ballast.models.weights_check import ModelFilesError, check_model_files
from ballast.trainer.run import fault_injection, signals
from ballast.workers.rollout import faults as rollout_faults
from ballast.trainer.config import BallastConfig, ConfigError, ModelInfo, to_typed, uses_critic
from ballast.trainer.config.gpu_memory import check_rollout_gpu_memory_at_start
from ballast.trainer.run.ray_session import RaySession, RayUnavailableError, probe_ray_address, start_ray  # noqa: F401

if TYPE_CHECKING:  # they load torch; the command line imports them once it runs
    from ballast.trainer.run.checkpoints import ResumePoint
    from ballast.trainer.run.data import RunData
    from ballast.trainer.step.reward import RewardManager
    from ballast.trainer.run.run_plan import RunPlan

EXIT_BAD_INPUT = 2
EXIT_WORKER_FAILED = 3
EXIT_NONFINITE = 4
EXIT_RAY_UNAVAILABLE = 5
WORKERS_FILE = "workers.json"  # rank -> pid, node id and IP of every worker of the run, in the run directory


class InputError(ConfigError):
    """Input the config points at (data, tokenizer, reward function) is unusable; found before any worker starts."""


def absolute_paths(cfg: BallastConfig) -> BallastConfig:
    """The same config with every local path made absolute (Ray workers run in other directories)."""
    def absolute(path):
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    arr = cfg.actor_rollout_ref
    model = dataclasses.replace(arr.model, path=absolute(arr.model.path), tokenizer_path=absolute(arr.model.tokenizer_path))
    critic_model = dataclasses.replace(cfg.critic.model, path=absolute(cfg.critic.model.path),
                                       tokenizer_path=absolute(cfg.critic.model.tokenizer_path))
    data = dataclasses.replace(cfg.data, train_files=[absolute(p) for p in cfg.data.train_files],
                               val_files=[absolute(p) for p in cfg.data.val_files] if cfg.data.val_files else None)
    trainer = dataclasses.replace(cfg.trainer, default_local_dir=absolute(cfg.trainer.default_local_dir))
    custom = cfg.custom_reward_function
    custom = dataclasses.replace(custom, path=absolute(custom.path))
    return dataclasses.replace(cfg, data=data, actor_rollout_ref=dataclasses.replace(arr, model=model),
                               critic=dataclasses.replace(cfg.critic, model=critic_model), trainer=trainer,
                               custom_reward_function=custom)


@dataclass(frozen=True)
class PreparedRun:
    """A run checked and read before Ray starts: its config (absolute paths), plan, data and reward."""

    cfg: BallastConfig
    plan: "RunPlan"
    data: "RunData"
    reward: "RewardManager"
    rm_tokenizer: Optional[object] = None  # reward.reward_model.enable: the reward model's tokenizer


def prepare_typed(cfg: BallastConfig) -> PreparedRun:
    """Model files, then the data (it decides the step count the plan needs), then the plan, the
    rollout backend and the reward function; all before Ray starts."""
    from ballast.trainer.run.builders import overlong_buffer
    from ballast.trainer.step.reward import RewardManager
    from ballast.trainer.run.preflight import check_lora_targets, unknown_agent_name
    from ballast.trainer.run.run_plan import plan_run

    cfg = absolute_paths(cfg)
    try:
        fault_injection.armed()  # a BALLAST_KILL_AT naming no point: refused before anything starts
        rollout_faults.armed()  # the same for BALLAST_ROLLOUT_FAULT
    except ValueError as err:
        raise InputError(str(err)) from None
    model = ModelInfo.from_dir(cfg.actor_rollout_ref.model.path)
    _check_model_files(cfg)
    tokenizer, data = read_data(cfg)
    plan = plan_run(cfg, model, data.total_steps)
    check_lora_targets(plan)
    unknown = unknown_agent_name(plan, data.agent_names)
    if unknown is not None:
        raise InputError(unknown)
    _announce_precision(cfg, plan)
    _check_rollout_backend(cfg)
    _check_code_reward(cfg, data)
    try:
        reward = RewardManager.from_config(tokenizer, cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                           cfg.data.reward_fn_key, overlong_buffer(cfg), cfg.reward.timeout_s,
                                           str(cfg.reward_model.reward_manager))
    except (ValueError, OSError, ImportError) as err:  # the messages name the file and the function
        raise InputError(str(err)) from err
    rm_tokenizer = None
    if plan.specs.reward_model is not None:
        from ballast.trainer.run.reward_model import check_reward_model

        rm_tokenizer = check_reward_model(cfg, plan.specs.reward_model.sizes, tokenizer)
    return PreparedRun(cfg=cfg, plan=plan, data=data, reward=reward, rm_tokenizer=rm_tokenizer)


def _check_code_reward(cfg: BallastConfig, data) -> None:
    """Rows scored by running their programs (`ballast.data.code_reward`) need the sandbox: build the
    reward now, so a machine that cannot isolate the code refuses the run before any worker starts."""
    from ballast.data.code_reward import check_code_sandbox
    from ballast.tools import SandboxUnavailableError

    if cfg.custom_reward_function.path or cfg.data.reward_fn_key != "data_source":
        return  # a custom function builds its own (a CodeReward there is built, and checked, when its file loads)
    sources = set(data.train_set.data_sources) | (set(data.val["data_source"]) if data.val is not None else set())
    try:
        check_code_sandbox(sources)
    except SandboxUnavailableError as err:
        raise InputError(f"data_source {', '.join(sorted(sources))}: {err}") from None


def _announce_precision(cfg: BallastConfig, plan) -> None:
    from ballast.trainer.config.fsdp import precision_notes
    from ballast.trainer.run.preflight import cpu_has_native_bf16, say

    arr, critic = plan.specs.actor_rollout_ref, plan.specs.critic
    engines = {"actor": arr.actor, "ref": arr.ref, "critic": critic.critic if critic is not None else None}
    precisions = {role: engine.precision for role, engine in engines.items() if engine is not None}
    for line in precision_notes(precisions, cfg.trainer.device, cpu_has_native_bf16()):
        say(line)


def read_data(cfg: BallastConfig):
    """(tokenizer, `RunData`): the driver's random generators seeded, then the prompts read and tokenized."""
    import torch

    from ballast.models import load_tokenizer
    from ballast.trainer.run.data import RunData

    random.seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    arr = cfg.actor_rollout_ref
    try:
        tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path)
        return tokenizer, RunData(cfg, tokenizer)
    except ConfigError:
        raise  # a setting the dataset or loader refused, named by its key
    except (ValueError, OSError, ImportError) as err:  # the messages name the file, row or path
        raise InputError(str(err)) from err


def _check_model_files(cfg: BallastConfig) -> None:
    for key, path in (("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path),
                      ("critic.model.path", cfg.critic.model.path if uses_critic(cfg) else None)):
        if path and os.path.isdir(path):
            try:
                check_model_files(path)
            except ModelFilesError as err:
                raise InputError(f"{key}: {err}") from None


def _check_rollout_backend(cfg: BallastConfig) -> None:
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        try:
            import vllm  # noqa: F401
        except Exception as err:  # an absent or broken install: both are start-up errors
            raise ConfigError(
                f"actor_rollout_ref.rollout.name=vllm but vllm cannot be imported ({type(err).__name__}: {err}); "
                "run scripts/setup.sh or use actor_rollout_ref.rollout.name=hf"
            ) from err
        check_rollout_gpu_memory_at_start(cfg)


@contextlib.contextmanager
def training_session(prepared: PreparedRun, raw_config: Optional[dict] = None,
                     resume: Optional[ResumePoint] = None):
    """Ray, workers and trackers for one prepared run; yields the `RayPPOTrainer`, already at `resume`
    (default: `trainer.resume_mode` resolved here, without the run-directory checks of the command
    line), and cleans up after (`shutdown`), however the block ends."""
    from tqdm import tqdm

    from ballast.trainer.run.preflight import resume_point
    from ballast.trainer.ray_trainer import RayPPOTrainer
    from ballast.trainer.run.workers import create_workers
    from ballast.trainer.run.tracking import Tracker

    cfg, plan = prepared.cfg, prepared.plan
    ray_session = tracker = workers = ended_by = None
    try:
        resume = resume if resume is not None else resume_point(cfg.trainer)
        _check_resume_layout(resume, plan.sizes)  # before any worker starts
        ray_session = start_ray(cfg)
        signals.reinstall()  # ray.init replaced the command line's handlers
        tracker = Tracker(cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name,
                          cfg.trainer.default_local_dir, config=raw_config, console=tqdm.write)
        print("ballast: derived sizes\n  " + "\n  ".join(plan.sizes.summary()), flush=True)
        workers = create_workers(cfg, plan.sizes, plan.specs)
        record_workers(workers, cfg.trainer.default_local_dir)
        with open(os.path.join(cfg.actor_rollout_ref.model.path, "config.json")) as f:
            model_config = json.load(f)
        reward = prepared.reward
        if workers.reward_model is not None:
            from ballast.trainer.run.reward_model import combined_reward

            reward = combined_reward(cfg, reward, reward.tokenizer, prepared.rm_tokenizer, plan.specs.reward_model,
                                     workers.reward_model)
        trainer = RayPPOTrainer(cfg, plan.sizes, prepared.data, workers, reward, tracker, model_config,
                                plan.old_log_probs)
        trainer.resume(resume)
        yield trainer
    except BaseException as err:
        ended_by = err
        raise
    finally:
        shutdown(ended_by, tracker, workers, ray_session)


def _check_resume_layout(point: ResumePoint, sizes) -> None:
    """A checkpoint saved under other pipeline sizes is refused here, naming the keys (the workers'
    engines would refuse it too, after Ray and the models started)."""
    from ballast.trainer.config.pipeline import resume_layout_refusal
    from ballast.trainer.run.checkpoints import CheckpointError

    refusal = None if point.fresh else resume_layout_refusal(point.checkpoint, sizes)
    if refusal is not None:
        raise CheckpointError(f"cannot resume from {point.checkpoint!r}: {refusal}")


def shutdown(err: Optional[BaseException], tracker, workers, ray_session: Optional[RaySession]) -> None:
    """Finish the trackers, stop the workers and Ray (for a local Ray: every process of it, and its
    directory), each step even when an earlier one fails. No signal can cut it short; past
    `signals.SHUTDOWN_DEADLINE_S` what the run started is killed (and the command line exits with the
    code that `err`, the error that ended the run, earns)."""
    code, line = outcome(err)
    kill = ray_session.kill_now if ray_session is not None else (lambda: None)
    with signals.shutdown_deadline(signals.SHUTDOWN_DEADLINE_S, kill, code, line):
        try:
            if tracker is not None:
                tracker.finish()
        finally:
            try:
                if workers is not None:
                    workers.shutdown()
            finally:
                if ray_session is not None:
                    ray_session.stop()


def run(prepared: PreparedRun, raw_config: Optional[dict] = None, resume: Optional[ResumePoint] = None) -> dict:
    """Train from `resume` (see `training_session`); returns the last step's metrics."""
    with training_session(prepared, raw_config, resume) as trainer:
        return trainer.fit()


def record_workers(workers, run_dir: str) -> list:
    """Write where each worker runs (rank, pid, node id, IP) to `<run_dir>/workers.json` and say so."""
    infos = workers.actor_rollout.placement()
    placed = [{"rank": rank, "pid": info["pid"], "node_id": info["node_id"], "node_ip": info["ip"]}
              for rank, info in enumerate(infos)]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, WORKERS_FILE), "w") as f:
        json.dump(placed, f, indent=1)
    ip_of = {p["node_id"]: p["node_ip"] for p in placed}
    ranks_on = {node: [p["rank"] for p in placed if p["node_id"] == node] for node in ip_of}
    print(f"ballast: {len(placed)} workers on {len(ip_of)} node(s): "
          + "; ".join(f"node {node[:8]} ({ip_of[node]}) ranks {ranks}" for node, ranks in ranks_on.items()), flush=True)
    return placed


def failure(err: BaseException) -> Tuple[int, str]:
    """The exit code and one-line reason for an error that ends a run."""
    from ballast.single_controller import PlacementError, WorkerError
    from ballast.trainer.run.checkpoints import CheckpointError
    from ballast.trainer.ray_trainer import DynamicSamplingError, NonFiniteStepsError
    from ballast.trainer.step.reward import RewardFunctionError
    from ballast.trainer.run.run_dir import RunDirError

    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    if isinstance(err, ConfigError):
        kind = "invalid input" if isinstance(err, InputError) else "invalid config"
        return EXIT_BAD_INPUT, f"{kind}: {' '.join(lines)}"
    if isinstance(err, RewardFunctionError):
        return EXIT_BAD_INPUT, f"reward function: {lines[0]}"
    if isinstance(err, RunDirError):
        return EXIT_BAD_INPUT, f"run directory: {' '.join(lines)}"
    if isinstance(err, CheckpointError):
        return EXIT_BAD_INPUT, f"checkpoint: {' '.join(lines)}"
    if _is_ray_oom(err):  # Ray's memory monitor killed workers; Ray raises this from ray.get, unwrapped
        return EXIT_WORKER_FAILED, f"worker failure: out of memory: {lines[0]}"
    if isinstance(err, WorkerError):
        # a remote exception: its first line names group, method and rank, its last line the error
        reason = f"{lines[0]} {lines[-1]}" if _is_remote_exception(err) and len(lines) > 1 else lines[0]
        return EXIT_WORKER_FAILED, f"worker failure: {reason}"
    if isinstance(err, (NonFiniteStepsError, DynamicSamplingError)):  # a guard of the training loop stopped it
        return EXIT_NONFINITE, f"training stopped: {lines[0]}"
    if isinstance(err, (RayUnavailableError, PlacementError)):
        return EXIT_RAY_UNAVAILABLE, f"ray cluster: {lines[0]}"
    return 1, f"{type(err).__name__}: {lines[0]}"


def _is_ray_oom(err: BaseException) -> bool:
    try:
        from ray.exceptions import OutOfMemoryError
    except ImportError:
        return False
    return isinstance(err, OutOfMemoryError)


def _is_remote_exception(err: BaseException) -> bool:
    from ballast.single_controller import WorkerError

    return type(err) is WorkerError


def outcome(err: Optional[BaseException]) -> Tuple[int, str]:
    """The exit code and last line (without `ballast: `) of a run that `err` ended; (0, "") for none."""
    if err is None:
        return 0, ""
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (signals.Terminated, or Ray's re-raise of it)
        if signals.was_terminated(err):
            return signals.EXIT_TERMINATED, "terminated"
        return signals.EXIT_INTERRUPTED, "interrupted"
    return failure(err)


def cli_run(raw: DictConfig, exiting: bool = False) -> int:
    """Validate and run one composed config; returns the process exit code (see the module docstring).
    `exiting`: the process exits right after (the command line): late signals are ignored, and a
    shutdown stuck past its deadline ends the process."""
    from ballast.trainer.run.preflight import claim_run_dir, refuse_early

    lock = None
    signals.install(save_first=bool(OmegaConf.select(raw, "trainer.save_on_signal", default=False)), exiting=exiting)
    try:
        cfg = to_typed(raw)
        refuse_early(cfg.trainer)  # a busy or occupied directory: refused before the data is read
        prepared = prepare_typed(cfg)
        point, lock = claim_run_dir(prepared.cfg)
        run(prepared, OmegaConf.to_container(raw, resolve=True), point)
        return 0
    except (KeyboardInterrupt, Exception) as err:
        signals.begin_shutdown()  # the outcome is decided: a signal from here on is only noted
        code, reason = outcome(err)
        _print_details(err, code)
        print(f"ballast: {reason}", file=sys.stderr, flush=True)
        return code
    finally:
        signals.uninstall(exiting=exiting)
        if lock is not None:
            lock.release()


def _print_details(err: BaseException, code: int) -> None:
    """What goes above the last line: a traceback for an unexpected error, the worker's traceback for a
    remote one, the user's own for a failing reward function."""
    import traceback

    if isinstance(err, KeyboardInterrupt):
        return
    if code == 1:
        traceback.print_exception(err, file=sys.stderr)
    elif _is_remote_exception(err):
        print(str(err), file=sys.stderr)
    elif _user_cause(err) is not None:
        traceback.print_exception(_user_cause(err), file=sys.stderr)


def _user_cause(err: BaseException) -> Optional[BaseException]:
    """The exception a user's reward function raised, when that is what ended the run."""
    from ballast.trainer.step.reward import RewardFunctionError

    return err.__cause__ if isinstance(err, RewardFunctionError) else None


@hydra.main(config_path="../configs", config_name="ppo_trainer", version_base=None)
def _hydra_main(raw: DictConfig) -> None:
    code = cli_run(raw, exiting=True)
    if code:
        sys.exit(code)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
