"""A local Ray instance closed to everyone but the run: loopback only, token authentication with a
token of its own, and workers that see only the environment they need.

* **Loopback.** Ray 2.60 offers no option to bind a local instance to 127.0.0.1 (`_node_ip_address`
  is resolved back to the machine's address); the node address is taken to be 127.0.0.1 by its
  single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the constant the driver already
  imported set the same way), and then the GCS, raylet, agents, workers and metrics ports listen on
  127.0.0.1 only.
* **Token authentication**, whatever `RAY_AUTH_MODE` says: every session gets a fresh random token
  in `<session dir>/auth_token` (mode 0600, in a directory of mode 0700 that nobody else can enter;
  Ray's own directories go below it, in `ray/`, where Ray makes them world-writable), and Ray's
  processes find it through `RAY_AUTH_TOKEN_PATH`. Nothing is written under the home directory
  (Ray's default `~/.ray/auth_token` is readable by every user).
* **Environment.** Ray's processes, and so every worker (a worker inherits the raylet's environment),
  start with `ray_process_env`: the variables a process needs to run and the settings families of
  the libraries a worker runs (`inherited`), minus names that look like credentials, plus the names
  the user lists in `ray_init.worker_env_vars`. A wandb key or a cloud credential in the driver's
  environment stays in the driver.

Both `BALLAST_RAY_SESSION=<id>` (the mark that proves a process is the run's, see
`ballast.trainer.run.ray_watchdog`) and `SPT_NOENV=1` (so that Ray's renamed processes keep that
mark readable) are added. A cluster (`ray_init.address`) keeps its own settings: its token is the
cluster's (`scripts/ray_cluster.sh` starts clusters with token authentication).
"""

from __future__ import annotations

import os
import secrets
from typing import Dict, Iterable, Mapping, Optional

from ballast.trainer.run.ray_watchdog import MARK

TOKEN_FILE = "auth_token"
RAY_DIR = "ray"  # Ray's own temporary directory, inside the session directory
# What a process needs to run at all: paths, locale, the user, the interpreter and its environment.
SYSTEM_VARS = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "PWD", "HOSTNAME",
    "TMPDIR", "TMP", "TEMP", "LD_LIBRARY_PATH", "LD_PRELOAD", "GLIBC_TUNABLES", "VIRTUAL_ENV", "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
})
# Settings families of what a worker runs: Ray, the Python interpreter, thread pools and the allocator,
# accelerators and their collectives, torch, Hugging Face, vLLM, Ballast.
SETTING_PREFIXES = (
    "LC_", "XDG_", "PYTHON", "RAY_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "MALLOC_", "CUDA_", "NVIDIA_",
    "CUBLAS_", "CUDNN_", "NCCL_", "GLOO_", "HIP_", "ROCR_", "HSA_", "TORCH", "PYTORCH_", "TRITON_", "HF_",
    "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_", "VLLM_", "BALLAST_",
)
# Words that make a name look like a credential, even inside those families (HF_TOKEN, VLLM_API_KEY).
SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "KEY", "APIKEY"})
# Set by the session itself (`ray_process_env`); the driver's values never pass.
_SESSION_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                 "SPT_NOENV", MARK)


def looks_secret(name: str) -> bool:
    """Whether `name` reads like a credential: one of its `_`-separated words is TOKEN, KEY, SECRET, ..."""
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def inherited(name: str, listed: Iterable[str] = ()) -> bool:
    """Whether the driver's variable `name` reaches Ray's processes and the workers (`listed`: the
    names of `ray_init.worker_env_vars`, which always do)."""
    if name in listed:
        return True
    if name in _SESSION_VARS or looks_secret(name):
        return False
    return name in SYSTEM_VARS or name.startswith(SETTING_PREFIXES)


def driver_vars(token_path: str) -> Dict[str, Optional[str]]:
    """What the driver's own environment holds while its local session lives (None: removed), so that
    its Ray client authenticates with the session's token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path, "RAY_AUTH_TOKEN": None}


def ray_process_env(environ: Mapping[str, str], listed: Iterable[str], session_id: str,
                    token_path: str) -> Dict[str, str]:
    """The environment Ray's processes (and through the raylet, the workers) start with: what
    `inherited` lets through of `environ`, the session's token, loopback mode and mark."""
    listed = frozenset(listed)
    env = {name: value for name, value in environ.items() if inherited(name, listed)}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                "SPT_NOENV": "1", MARK: session_id})
    return env


def new_session_id() -> str:
    return secrets.token_hex(8)


def write_token(session_dir: str) -> str:
    """A fresh random token in `<session_dir>/auth_token`, readable by its owner only; returns its path.
    The directory itself is made owner-only too (mkdtemp already does)."""
    os.chmod(session_dir, 0o700)
    path = os.path.join(session_dir, TOKEN_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def apply(values: Mapping[str, Optional[str]]) -> Dict[str, Optional[str]]:
    """Set (or, for None, remove) variables of this process; returns what they were before."""
    before = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return before


def reload_ray_auth() -> None:
    """Make an already imported Ray read its authentication settings and token from the environment
    again (Ray caches both per process; Ray's own default token set-up does the same)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def set_single_machine(enabled: bool) -> bool:
    """Make this process's Ray take 127.0.0.1 as its node address (`enabled`) or not; returns the
    previous setting. Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when it is imported: the driver's
    copy of that constant is set here, the processes Ray starts read the variable."""
    from ray._private import ray_constants

    before = not ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = not enabled
    return before
