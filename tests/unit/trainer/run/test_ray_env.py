"""What a local Ray's processes, and so the workers, start with: the variables a process needs and the
settings families of the worker's libraries, never a credential unless `ray_init.worker_env_vars`
lists it, never the driver's own Ray token or session settings; plus the session's closed settings.
A bad name in `ray_init.worker_env_vars` is a start-up error naming it."""

import os
import stat

import pytest

from ballast.trainer.config import ConfigError, check_rules, load_config
from ballast.trainer.run import ray_env
from ballast.trainer.run.ray_watchdog import MARK

DRIVER = {
    "PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/v",
    "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "HF_HOME": "/hf", "VLLM_CPU_KVCACHE_SPACE": "1", "BALLAST_CACHE_DIR": "/c", "RAY_DEDUP_LOGS": "0",
    "WANDB_API_KEY": "w", "HF_TOKEN": "h", "VLLM_API_KEY": "v", "AWS_SECRET_ACCESS_KEY": "a", "OPENAI_API_KEY": "o",
    "GITHUB_TOKEN": "g", "SSH_AUTH_SOCK": "/tmp/agent", "DISPLAY": ":0", "MY_SETTING": "x", "DB_PASSWORD": "p",
    "RAY_AUTH_TOKEN": "the-users-cluster-token", "RAY_AUTH_MODE": "disabled", MARK: "another-session",
}
PASSED = {"PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG",
          "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "BALLAST_CACHE_DIR",
          "RAY_DEDUP_LOGS"}


def test_ray_processes_get_what_a_worker_needs_and_no_credential_unless_listed():
    env = ray_env.ray_process_env(DRIVER, listed=["MY_SETTING", "OPENAI_API_KEY"], session_id="s1", token_path="/t")
    session = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/t", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "SPT_NOENV": "1", MARK: "s1"}
    assert env == {**{k: DRIVER[k] for k in PASSED | {"MY_SETTING", "OPENAI_API_KEY"}}, **session}


@pytest.mark.parametrize("name, secret", [("HF_TOKEN", True), ("TOKENIZERS_PARALLELISM", False), ("MY_KEY", True),
                                          ("KEYBOARD", False), ("aws_secret_access_key", True), ("PASSWORD", True)])
def test_a_name_looks_like_a_credential_by_its_words(name, secret):
    assert ray_env.looks_secret(name) is secret


def test_the_session_token_is_fresh_and_owner_only(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(mode=0o755)
    second.mkdir()
    paths = [ray_env.write_token(str(first)), ray_env.write_token(str(second))]
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in paths] == [0o600, 0o600]
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o700
    tokens = [open(p).read() for p in paths]
    assert tokens[0] != tokens[1] and len(tokens[0]) == 64


def test_a_bad_worker_env_var_name_is_a_start_up_error():
    cfg = load_config(["data.train_files=/t.parquet", "actor_rollout_ref.model.path=/m",
                       "ray_init.worker_env_vars=[GOOD_NAME,'not a name']"])
    with pytest.raises(ConfigError, match=r"ray_init\.worker_env_vars\[1\]='not a name' is not an environment variable"):
        check_rules(cfg)
