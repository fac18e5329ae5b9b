"""The launch scripts parse, refuse bad arguments before touching Ray, and gpu_smoke.sh refuses to run
(exit 2, saying why) on a machine without a usable NVIDIA GPU; the Dockerfile keeps its promises."""

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "scripts" / "ray_cluster.sh", ROOT / "scripts" / "gpu_smoke.sh", ROOT / "examples" / "ray_job_grpo.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_parses_and_is_executable(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.stat().st_mode & stat.S_IXUSR


def _run(args, env=None, path=None):
    env = dict(os.environ if env is None else env)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", *map(str, args)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, fragment", [
    ([], "usage:"),
    (["nodes"], "unknown role 'nodes'"),
    (["worker"], "worker needs --address HEAD_IP:PORT"),
    (["worker", "--address", "headnode"], "--address must be HOST:PORT, got 'headnode'"),
    (["head", "--num-cpus", "two"], "--num-cpus must be a whole number, got 'two'"),
    (["head", "--port", "63x"], "--port must be a whole number, got '63x'"),
    (["head", "--auth", "maybe"], "--auth must be 'token' or 'disabled', got 'maybe'"),
    (["head", "--address", "h:1"], "--address is for 'worker'"),
    (["head", "--bogus"], "unknown option '--bogus'"),
])
def test_ray_cluster_rejects_bad_arguments_before_starting_ray(args, fragment):
    proc = _run([ROOT / "scripts" / "ray_cluster.sh", *args])
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr


def test_worker_with_token_auth_and_no_token_says_how_to_get_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token there
    proc = _run([ROOT / "scripts" / "ray_cluster.sh", "worker", "--address", "127.0.0.1:6379"], env=env)
    assert proc.returncode == 2
    assert "no token here: copy the head's ~/.ray/auth_token, or export RAY_AUTH_TOKEN" in proc.stderr


@pytest.mark.parametrize("existing", [False, True])
def test_the_heads_token_file_is_readable_by_its_owner_only(tmp_path, existing):
    # a stand-in `ray` that writes the token as Ray 2.60 does (open(path, "w"): mode 0666 less the umask)
    fake = tmp_path / "ray"
    fake.write_text('#!/bin/bash\nif [[ "$1" == get-auth-token ]]; then mkdir -p "$HOME/.ray"; '
                    'echo t > "$HOME/.ray/auth_token"; fi\nexit 0\n')
    fake.chmod(0o755)
    token = tmp_path / ".ray" / "auth_token"
    if existing:  # made earlier, world-readable
        token.parent.mkdir()
        token.write_text("t")
        token.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), BALLAST_RAY_BIN=str(fake))
    proc = _run([ROOT / "scripts" / "ray_cluster.sh", "head"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_worker_gives_up_when_the_head_never_answers():
    proc = _run([ROOT / "scripts" / "ray_cluster.sh", "worker", "--address", "127.0.0.1:1", "--auth", "disabled",
                 "--wait-s", "1"])
    assert proc.returncode == 2
    assert "the head did not answer at 127.0.0.1:1 within 1s" in proc.stderr


def _fake_bin(tmp_path, nvidia_smi_body):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/bash\n{nvidia_smi_body}\n")
    fake.chmod(0o755)
    return f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"


def test_gpu_smoke_refuses_without_nvidia_smi():
    if shutil.which("nvidia-smi", path="/usr/bin:/bin"):
        pytest.skip("this machine has nvidia-smi")
    proc = _run([ROOT / "scripts" / "gpu_smoke.sh"], path="/usr/bin:/bin")
    assert proc.returncode == 2
    assert "nvidia-smi not found: this script needs an NVIDIA GPU machine" in proc.stderr


def test_gpu_smoke_refuses_when_nvidia_smi_fails(tmp_path):
    path = _fake_bin(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the driver"; exit 9')
    proc = _run([ROOT / "scripts" / "gpu_smoke.sh"], path=path)
    assert proc.returncode == 2
    assert "nvidia-smi failed, no usable GPU" in proc.stderr


def test_gpu_smoke_refuses_when_torch_sees_no_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    path = _fake_bin(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    proc = _run([ROOT / "scripts" / "gpu_smoke.sh"], path=f"{Path(sys.executable).parent}{os.pathsep}{path}")
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr


def test_dockerfile_promises():
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)", text, re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu\d\d\.\d\d", base), base  # pinned, never :latest
    assert re.search(r'pip install "vllm==[\d.]+"', text) and "flash-attn" in text
    assert 'pip install -e ".[gpu,test]"' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["python", "-m", "ballast.trainer.main"\]', text, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git", "checkpoints", "outputs"} <= set(ignored)
    # flash-attn compiles (no wheel for torch 2.14 + CUDA 13): one architecture by default, few jobs,
    # a host compiler, and ninja installed before the --no-build-isolation build that needs it.
    archs = re.search(r"^ARG FLASH_ATTN_CUDA_ARCHS=(\S+)", text, re.M).group(1)
    assert ";" not in archs, archs
    assert int(re.search(r"^ARG MAX_JOBS=(\d+)", text, re.M).group(1)) <= 4
    assert "build-essential" in text and text.index("pip install ninja") < text.index('"flash-attn==')
    # every documented `docker run --gpus` gets /dev/shm room for NCCL, and the host driver is stated
    runs = [line for line in text.splitlines() if "docker run --gpus" in line]
    assert runs and all("--ipc=host" in line or "--shm-size" in line for line in runs), runs
    assert re.search(r"driver .*580", text)
