"""Translate pip's configuration into `uv pip install` options, for scripts/setup.sh.

setup.sh installs with uv when it can: uv resolves, downloads and unpacks in parallel, so a fresh venv
takes ~50 s instead of ~150 s with pip on a 2-core machine. The packages must be the ones pip would
pick: same indexes, find-links and constraints (a machine's pip.conf or PIP_* variables, e.g. a local
mirror holding the CPU build of torch), and pip's rule of taking the best version across all indexes.

Reads `pip config list` on stdin; prints one option per line (for a bash array), or exits 1 naming the
setting it cannot carry over, so that setup.sh falls back to pip.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Tuple

# pip settings uv takes as options of the same meaning (a pip value may list several, space-separated)
_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
            "constraint": "--constraint"}
# pip settings that change nothing about which files get installed
_IGNORED = {"default-timeout", "timeout", "disable-pip-version-check", "progress-bar", "no-cache-dir", "cache-dir",
            "quiet", "verbose", "root-user-action", "retries", "no-input", "no-color", "require-virtualenv"}


def parse_pip_config(text: str) -> List[Tuple[str, str]]:
    """(setting, value) pairs from `pip config list` lines such as `global.find-links='/opt/wheels'`."""
    pairs = []
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep:
            continue
        pairs.append((key.rsplit(".", 1)[-1], value.strip().strip("'\"")))
    return pairs


def uv_options(pairs: List[Tuple[str, str]]) -> Tuple[List[str], Dict[str, str]]:
    """(uv options, environment variables) equivalent to pip's settings; ValueError for a setting uv
    would not honour the same way."""
    options: List[str] = ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]
    env: Dict[str, str] = {}
    seen = set()
    for key, value in pairs:
        if key in _IGNORED:
            continue
        if key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key in _OPTIONS:
            for item in value.split():
                if (key, item) not in seen:
                    options += [_OPTIONS[key], item]
                    seen.add((key, item))
        else:
            raise ValueError(f"pip setting {key}={value!r} has no uv equivalent here")
    return options, env


def main() -> int:
    try:
        options, env = uv_options(parse_pip_config(sys.stdin.read()))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    for name, value in env.items():
        print(f"env:{name}={value}")
    for option in options:
        print(option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
