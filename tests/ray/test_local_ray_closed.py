"""The quickstart's local Ray is closed: started the way the trainer starts it (`start_ray` on the
quickstart config, in a driver process of its own), every socket its processes listen on is bound to
the loopback interface, its GCS refuses a call without the session's token and answers one with it,
the token file is readable by its owner only and nothing is written to the home directory; and a
worker sees the driver's secrets only when `ray_init.worker_env_vars` lists them. One Ray start."""

import json
import os
import stat
import subprocess
import sys

import grpc
import psutil
import pytest

from testkit.procs import processes_using

_DRIVER = r"""
import json, os, sys
from ballast.trainer.config import load_config
from ballast.trainer.run.ray_session import start_ray
from ballast.trainer.run.workers import worker_env

cfg = load_config(["ray_init.num_cpus=1", "ray_init.worker_env_vars=[MY_LISTED_TOKEN]"], config_name="quickstart")
os.environ.update(WANDB_API_KEY="w-secret", HF_TOKEN="hf-secret", UNLISTED_PLAIN="plain", MY_LISTED_TOKEN="listed")
session = start_ray(cfg)
import ray

@ray.remote(num_cpus=0)
class Probe:
    def environ(self):
        return dict(os.environ)

probe = Probe.options(runtime_env={"env_vars": worker_env(cfg.ray_init.worker_env_vars)}).remote()
env = ray.get(probe.environ.remote())
print(json.dumps({"temp_dir": session.temp_dir, "pids": session.processes(), "gcs": ray.get_runtime_context().gcs_address,
                  "token": os.environ["RAY_AUTH_TOKEN_PATH"], "worker_env": env}), flush=True)
sys.stdin.readline()
session.stop()
print("stopped", flush=True)
"""
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
SECRETS = {"WANDB_API_KEY": "w-secret", "HF_TOKEN": "hf-secret", "UNLISTED_PLAIN": "plain"}


def _listening(pids):
    """(pid, name, ip, port) of every TCP socket listening and every UDP socket bound, of `pids`."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr):  # SOCK_DGRAM
                    found.append((pid, proc.name(), conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            continue
    return found


def _check_alive(gcs, metadata=()):
    with grpc.insecure_channel(gcs) as channel:
        try:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/CheckAlive")(b"", timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()


@pytest.mark.timeout(300)
def test_the_quickstarts_local_ray_listens_on_loopback_with_a_token_and_keeps_the_drivers_secrets(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), RAY_AUTH_MODE="disabled")  # a leftover opt-out must not open the local instance
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    line = driver.stdout.readline()
    while line and not line.startswith("{"):  # the session's own lines come first
        line = driver.stdout.readline()
    if not line:
        pytest.fail(f"the driver ended before its Ray started: {driver.communicate(timeout=60)[1][-3000:]}")
    info = json.loads(line)
    try:
        pids = sorted({driver.pid, *info["pids"], *processes_using(info["temp_dir"])})
        sockets = _listening(pids)
        assert len(info["pids"]) >= 5 and len(sockets) >= 5, (info["pids"], sockets)  # GCS, raylet, agents, worker
        open_ = [s for s in sockets if s[2] not in LOOPBACK]
        assert not open_, f"listening beyond the loopback interface: {open_}"

        assert _check_alive(info["gcs"]) == grpc.StatusCode.UNAUTHENTICATED
        token = open(info["token"]).read().strip()
        assert _check_alive(info["gcs"], (("authorization", f"Bearer {token}"),)) == grpc.StatusCode.OK
        assert stat.S_IMODE(os.stat(info["token"]).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(info["temp_dir"]).st_mode) == 0o700
        assert list(home.iterdir()) == [], "Ray wrote into the home directory"

        worker = info["worker_env"]
        assert worker.get("MY_LISTED_TOKEN") == "listed"
        assert not {k for k in SECRETS if k in worker}, "a driver variable reached the worker unlisted"
        for pid in info["pids"]:  # nor any of Ray's processes (a worker inherits the raylet's environment)
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
            assert not [v for v in SECRETS.values() if v in environ], pid
    finally:
        out, err = driver.communicate(input="\n", timeout=120)
    assert driver.returncode == 0 and "stopped" in out, err[-3000:]
    assert not os.path.exists(info["temp_dir"])
