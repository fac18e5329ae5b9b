"""scripts/uv_args.py: pip's configuration carried over to uv, so setup.sh's uv installs the packages
pip would pick (same indexes, find-links, constraints, best version across indexes) or falls back."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "uv_args.py"
_spec = importlib.util.spec_from_file_location("uv_args", SCRIPT)
uv_args = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_args)

# `pip config list` as this machine prints it: a file and the environment may repeat a setting
PIP_CONFIG = """global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
"""


def test_every_setting_that_decides_the_packages_is_carried_over_once():
    options, env = uv_args.uv_options(uv_args.parse_pip_config(PIP_CONFIG))
    assert options[:3] == ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]
    pairs = list(zip(options[3::2], options[4::2]))
    assert sorted(pairs) == sorted([("--constraint", "/etc/xdg/pip/constraints.txt"),
                                    ("--extra-index-url", "file:///opt/pypi/simple"),
                                    ("--extra-index-url", "file:///opt/pypi-more/simple"),
                                    ("--find-links", "/opt/wheels")])
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}


def test_a_setting_uv_would_not_honour_makes_setup_fall_back_to_pip():
    run = subprocess.run([sys.executable, str(SCRIPT)], input=PIP_CONFIG + "global.trusted-host='mirror.local'\n",
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout == ""
    assert "trusted-host='mirror.local'" in run.stderr
    ok = subprocess.run([sys.executable, str(SCRIPT)], input=PIP_CONFIG, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == "env:SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"
    assert "--find-links" in ok.stdout.splitlines()
