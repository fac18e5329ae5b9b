"""tiny_model_dir: builds once into $BALLAST_CACHE_DIR/models, reuses it, and survives two
processes building the same model at the same moment (atomic rename; loser adopts winner's copy)."""

import multiprocessing as mp
import os

import pytest
from transformers import AutoModelForCausalLM

from ballast.models import tiny as tiny_module
from ballast.models import tiny_model_dir


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BALLAST_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _counting_builder(counter, barrier=None):
    real = tiny_module.build_tiny_model

    def build(*args, **kwargs):
        path = real(*args, **kwargs)
        with counter.get_lock():
            counter.value += 1
        if barrier is not None:
            barrier.wait(timeout=120)  # both builds finish before either renames: a real race
        return path

    return build


def test_second_call_reuses_the_cached_build(cache_dir, monkeypatch):
    counter = mp.get_context("fork").Value("i", 0)
    monkeypatch.setattr(tiny_module, "build_tiny_model", _counting_builder(counter))
    first = tiny_model_dir("tiny")
    assert first.parent == cache_dir / "models"
    assert first.name.startswith("tiny-")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = tiny_model_dir("tiny")
    assert second == first
    assert counter.value == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # different settings, different directory (and a second build)
    other = tiny_model_dir("tiny", num_hidden_layers=3)
    assert other != first and counter.value == 2
    assert sorted(p.name for p in (cache_dir / "models").iterdir()) == sorted([first.name, other.name])


def _race_child(barrier, counter, queue):
    tiny_module.build_tiny_model = _counting_builder(counter, barrier)
    queue.put(str(tiny_model_dir("tiny")))


def test_two_processes_racing_end_with_one_complete_model(cache_dir):
    ctx = mp.get_context("fork")
    barrier, counter, queue = ctx.Barrier(2), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_race_child, args=(barrier, counter, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    paths = {queue.get(timeout=5), queue.get(timeout=5)}
    assert counter.value == 2  # both really built
    assert len(paths) == 1
    (path,) = paths
    assert os.listdir(cache_dir / "models") == [os.path.basename(path)]  # no temp leftovers
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == tiny_module.build_info(path)["num_params"]
