"""Stale vLLM CPU shared-memory cleanup removes only files no live process holds."""

from ballast.workers.rollout.vllm_shm import clean_stale_vllm_shm, vllm_shm_files


def test_only_unused_cpushm_files_are_removed(tmp_path):
    stale = tmp_path / "-tp:0-[0-1]-cpushm_0"
    held = tmp_path / "-tp:0-[0-1]-cpushm_1"
    other = tmp_path / "unrelated"
    for path in (stale, held, other):
        path.write_bytes(b"x")
    assert vllm_shm_files(str(tmp_path)) == sorted([str(stale), str(held)])
    with open(held, "rb"):  # a live process (this one) holds it: it must survive
        removed = clean_stale_vllm_shm(str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists() and held.exists() and other.exists()
    assert clean_stale_vllm_shm(str(tmp_path / "missing")) == []
