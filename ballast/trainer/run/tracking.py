"""Experiment tracking: console, wandb, tensorboard and a jsonl file, behind one `log(metrics, step)`;
what the terminal shows (progress-bar numbers, validation lines) and how much of it.

wandb runs offline automatically when no API key is configured (no WANDB_API_KEY and no netrc entry),
so a run never blocks on a login prompt; the config is logged with anything that looks like a secret
removed.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
from typing import Dict, Iterable, List, Literal, Optional, get_args

LoggerName = Literal["console", "wandb", "tensorboard", "jsonl"]
LOGGERS: tuple[str, ...] = get_args(LoggerName)

# Whole-word endings only: `wandb_api_key`, `hf_token`, `password` are secrets; config keys such as
# `ppo_max_token_len_per_gpu` or `prompt_key` are not.
_SECRET = re.compile(r"(^|_)(api_?key|access_?key|secret(_key)?|token|password|passwd|auth|credentials?)$",
                     re.IGNORECASE)


def redact(value):
    """A copy of a nested config dict with secret-looking keys' values replaced."""
    if isinstance(value, dict):
        return {k: ("***" if _SECRET.search(str(k)) and v is not None else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


# Set to 1 to stream every worker's output (vLLM, Triton, torch warnings, Ray notices) to the
# terminal; by default it goes to `<default_local_dir>/logs/<group>_rank<r>.log`.
VERBOSE_ENV = "BALLAST_VERBOSE"
WORKER_LOG_SUBDIR = "logs"


def verbose_output() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def worker_log_dir(run_dir: str) -> Optional[str]:
    """Where workers write their output, or None when it streams to the terminal (BALLAST_VERBOSE)."""
    return None if verbose_output() else os.path.join(run_dir, WORKER_LOG_SUBDIR)


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class Tracker:
    def __init__(self, loggers: Iterable[str], project: str, experiment: str, run_dir: str,
                 config: Optional[dict] = None, console=print) -> None:
        self.loggers = list(loggers)
        self.run_dir = run_dir
        self._console = console
        self._wandb = self._tb = self._jsonl = None
        os.makedirs(run_dir, exist_ok=True)
        safe_config = redact(config or {})
        if "wandb" in self.loggers:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_has_key() else "offline")
            self._wandb = wandb.init(project=project, name=experiment, config=safe_config, dir=run_dir, mode=mode)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        self._jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        if "jsonl" in self.loggers:
            self._jsonl = open(self._jsonl_path, "a", buffering=1)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(safe_config, f, indent=2, default=str)

    def rewind(self, step: int) -> None:
        """Make metrics.jsonl describe this run: keep only the rows up to `step`, the step a resumed run
        continues from (0 for a fresh start), so steps replayed after a crash are not listed twice. A
        last row cut short (the process was killed while writing it, a full disk) is dropped too: its
        step comes after the checkpoint (rows are written before a step's save)."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        keep = []
        if step > 0 and os.path.isfile(self._jsonl_path):
            with open(self._jsonl_path) as f:
                lines = [line for line in f if line.strip()]
            if lines and not _is_json_row(lines[-1]):
                lines.pop()
            keep = [line for line in lines if json.loads(line).get("step", 0) <= step]
        with open(self._jsonl_path, "w") as f:
            f.writelines(keep)
        self._jsonl = open(self._jsonl_path, "a", buffering=1)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v))
                                                            for k, v in clean.items()}}) + "\n")
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if "console" in self.loggers:
            self._console(format_console(clean, step))

    def console(self, line: str) -> None:
        """A line for the user's terminal (above the progress bar), whatever loggers are configured."""
        self._console(line)

    def log_images(self, images: Dict[str, str], step: int) -> None:
        """PNG files (already saved in the run directory) as wandb/tensorboard images."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({k: wandb.Image(path) for k, path in images.items()}, step=step)
        if self._tb is not None:
            import numpy as np
            from PIL import Image

            for key, path in images.items():
                self._tb.add_image(key, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")

    def finish(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


CONSOLE_KEYS: List[str] = [
    "critic/score/mean", "val/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss",
    "response_length/mean", "global_seqlen/balanced_imbalance", "perf/num_micro_batches", "timing_s/step",
]


# The progress bar's numbers: (metric, short name).
PROGRESS_KEYS = [("critic/score/mean", "score"), ("actor/pg_loss", "pg_loss"), ("response_length/mean", "resp_len"),
                 # rollout correction: the rollout/training mismatch, and what rejection dropped
                 ("rollout_corr/k3_kl", "mismatch_kl"), ("rollout_corr/rollout_rs_masked_fraction", "rejected")]


def _is_json_row(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return line.endswith("\n")


def progress_postfix(metrics: Dict[str, float]) -> Dict[str, str]:
    return {short: f"{metrics[key]:.3g}" for key, short in PROGRESS_KEYS if key in metrics}


def format_validation(metrics: Dict[str, float], step: int) -> str:
    """One line per validation: the mean score, then each data source's when there are several."""
    scores = {k[len("val/score/"):]: v for k, v in metrics.items() if k.startswith("val/score/") and k != "val/score/mean"}
    parts = [f"validation at step {step}: score {metrics['val/score/mean']:.3f}"]
    if len(scores) > 1:
        parts.append(", ".join(f"{src} {v:.3f}" for src, v in sorted(scores.items())))
    if "val/response_length/mean" in metrics:
        parts.append(f"response length {metrics['val/response_length/mean']:.1f}")
    return " | ".join(parts)


def format_console(metrics: Dict[str, float], step: int) -> str:
    parts = [f"step {step}"]
    for key in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{key}={metrics[key]:.4g}")
    return " | ".join(parts)
