"""scripts/setup.sh refuses a Python older than vLLM's before it installs anything.

A copy of the script runs in a scratch repository with stand-in interpreters that report a version
(and fail at anything else), so nothing is created or installed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _python(path: Path, version: str) -> Path:
    """A stand-in interpreter: prints `version` for setup.sh's version query, fails at anything else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!/usr/bin/env bash
if [[ "$1" == "-c" && "$2" == *version_info* ]]; then echo "{version}"; exit 0; fi
if [[ "$1" == "--version" ]]; then echo "Python {version}.9"; exit 0; fi
echo "stand-in python {version}: $*" >&2; exit 3
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _setup(tmp_path: Path, python: Path) -> subprocess.CompletedProcess:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    # no nvidia-smi on PATH (the CPU stack); the rest of the PATH for bash's own tools
    env = dict(os.environ, PYTHON=str(python), PATH=os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()))
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=60)


def test_python_3_10_is_refused_before_anything_is_installed(tmp_path):
    run = _setup(tmp_path, _python(tmp_path / "bin" / "python3.10", "3.10"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "is Python 3.10; Ballast's vLLM stack needs Python >= 3.11" in run.stderr
    assert "set PYTHON=python3.11" in run.stderr
    assert not (tmp_path / "repo" / ".venv").exists()
    assert "stand-in python" not in run.stderr  # nothing but the version query reached the interpreter


def test_python_3_11_and_3_12_pass_the_check(tmp_path):
    for version in ("3.11", "3.12"):
        run = _setup(tmp_path, _python(tmp_path / "bin" / f"python{version}", version))
        # past the check, the stand-in refuses to build the venv
        assert "needs Python >= 3.11" not in run.stderr, run.stderr
        assert f"python: Python {version}.9" in run.stdout and "python -m venv failed" in run.stderr


def test_an_existing_venv_built_with_an_old_python_is_refused_too(tmp_path):
    _python(tmp_path / "repo" / ".venv" / "bin" / "python", "3.10")
    run = _setup(tmp_path, _python(tmp_path / "bin" / "python3.12", "3.12"))
    assert run.returncode == 1 and ".venv/bin/python is Python 3.10" in run.stderr, run.stderr
    assert "and remove" in run.stderr

