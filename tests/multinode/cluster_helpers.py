"""A two-node Ray cluster on one machine, started with scripts/ray_cluster.sh, and trainer subprocesses.

Each node is a `ray_cluster.sh ... --block` process in its own session: SIGTERM stops that node's Ray
processes, and the process group (whose id we own) is the fallback for SIGKILL. Every process of the
cluster carries the cluster's unique temp directory on its command line, which is how the teardown
proves nothing was left behind. The pytest process itself never joins the cluster (it may hold the
tests/e2e session Ray): everything talks to it from subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = ROOT / "scripts" / "ray_cluster.sh"

# Lists the alive nodes once `want` of them have registered (or the deadline passes).
_NODES_SNIPPET = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
want, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print("NODES=" + json.dumps([{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
                              "cpus": n["Resources"].get("CPU", 0)} for n in alive]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of every cluster process and driver: venv first on PATH, offline, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def _processes_mentioning(text: str) -> List[int]:
    """Pids of this machine's processes whose command line contains `text` (a path only we created)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


class LocalCluster:
    """Head + one worker node on this machine, token auth on, 1 CPU each (so a 1-bundle-per-node
    pool cannot fit both bundles on one node)."""

    def __init__(self, num_cpus_per_node: int = 1, dashboard: bool = True) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths have a limit
        token = Path(self.temp_dir, "auth_token")
        token.write_text(uuid.uuid4().hex)
        self.env = base_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}" if dashboard else None
        self.num_cpus = num_cpus_per_node
        self.dashboard = dashboard
        self.nodes: List[dict] = []
        self._procs: List[subprocess.Popen] = []

    def _spawn(self, role: str, *args: str) -> None:
        log = open(Path(self.temp_dir, f"{role}.log"), "w")
        self._procs.append(subprocess.Popen(
            ["bash", str(CLUSTER_SCRIPT), role, "--block", "--num-cpus", str(self.num_cpus), *args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.temp_dir))

    def start(self, timeout_s: float = 150.0) -> "LocalCluster":
        head = ["--port", str(self.port), "--temp-dir", self.temp_dir]
        head += ["--dashboard-port", str(self.dashboard_port)] if self.dashboard else ["--no-dashboard"]
        # Ray's fixed default ports (dashboard agent 52365, client server 10001) may be held by another Ray
        # on this machine (the tests/e2e session instance), and both nodes here share one machine.
        self._spawn("head", *head, "--", f"--dashboard-agent-listen-port={free_port()}",
                    f"--ray-client-server-port={free_port()}")
        self._spawn("worker", "--address", self.address, "--wait-s", str(int(timeout_s)), "--",
                    f"--dashboard-agent-listen-port={free_port()}")
        out = subprocess.run([sys.executable, "-c", _NODES_SNIPPET, self.address, "2", str(timeout_s)],
                             env=self.env, capture_output=True, text=True, timeout=timeout_s + 60)
        line = [x for x in out.stdout.splitlines() if x.startswith("NODES=")]
        self.nodes = json.loads(line[-1][6:]) if line else []
        if len(self.nodes) != 2:
            self.stop()
            raise RuntimeError(f"two-node cluster did not come up: nodes={self.nodes}\n{out.stderr[-3000:]}\n"
                               + self.logs())
        if self.dashboard:
            self._wait_for_port(self.dashboard_port, timeout_s)
        return self

    def _wait_for_port(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"dashboard port {port} never answered\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for role in ("head", "worker"):
            path = Path(self.temp_dir, f"{role}.log")
            if path.exists():
                parts.append(f"--- {role}.log ---\n" + path.read_text()[-2000:])
        return "\n".join(parts)

    def stop(self, grace_s: float = 45.0) -> List[int]:
        """Stop both nodes; returns the pids that had to be SIGKILLed after the graceful stop."""
        for proc in reversed(self._procs):  # the worker node first, then the head
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s  # a node drains for up to 30 s before it stops
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        forced = []
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # our own process groups: nothing else lives there
                forced.append(proc.pid)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=10)
        for pid in _processes_mentioning(self.temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
                forced.append(pid)
            except ProcessLookupError:
                pass
        self._procs = []
        return forced

    def leftover_processes(self) -> List[int]:
        return _processes_mentioning(self.temp_dir)


def run_trainer(overrides: List[str], cwd: str, env: Dict[str, str], timeout_s: float = 300.0):
    """`python -m ballast.trainer.main <overrides>` in a subprocess; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "ballast.trainer.main", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def metric_rows(run_dir: str) -> List[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
