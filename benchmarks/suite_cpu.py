"""Where the test suite's CPU goes: every process it starts, its CPU seconds, and the test that started it.

    sudo .venv/bin/python benchmarks/suite_cpu.py --json out.json -- -n 2 tests   # any pytest arguments

The suite is CPU-bound on 2 cores (both busy >95% of its wall time), mostly on process start-ups
(Ray workers, command-line drivers, spawned ranks), which pytest's durations do not show: a test's
wall time depends on what the other pytest-xdist worker runs beside it. This runs pytest with Linux
process accounting on (`acct(2)`: the kernel writes one record per process at its exit, with its
user+system CPU, parent and start time) and a plugin logging when each test starts on which worker;
each process is charged to the test running on the pytest worker it descends from when it started
(Ray workers of the suite's shared Ray descend from the worker that started it). Needs root (acct)
and Linux; processes still alive at the end are not counted.

The JSON: wall seconds, the machine's CPU split over the run (/proc/stat), CPU seconds and process
counts by process name (`ray::ActorRolloutRef`-style titles are cut to 15 characters by the kernel),
and by test file and by test, largest first.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also when loaded by path
from machine import cpu_model  # noqa: E402

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime
# (float), utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t: 13-bit mantissa, base-8 exponent,
# clock ticks of 1/100 s), comm[16]
_RECORD = struct.Struct("<BBHIIIIIIf8H16s")
_PLUGIN = '''
import os, time
_f = open(os.environ["BALLAST_SUITE_CPU_TRACE"], "a", buffering=1)
def pytest_runtest_logstart(nodeid, location):
    _f.write(f"{time.time():.3f}\\t{os.getpid()}\\t{nodeid}\\n")
'''
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _comp(value: int) -> float:
    return ((value & 0x1FFF) << (3 * (value >> 13))) / 100.0


def read_accounting(path: str) -> list:
    """One dict per process record: comm, pid, ppid, start (epoch s), cpu (user + system s)."""
    data = open(path, "rb").read()
    records = []
    for offset in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        f = _RECORD.unpack_from(data, offset)
        records.append({"comm": f[-1].split(b"\0")[0].decode(errors="replace"), "pid": f[6], "ppid": f[7],
                        "start": f[8], "cpu": _comp(f[10]) + _comp(f[11])})
    return records


def charge_to_tests(records: list, starts: dict) -> dict:
    """{test node id: cpu seconds} for the processes descending from a pytest worker in `starts`
    ({worker pid: sorted [(start time, node id)]}); the rest under "(not under a test)"."""
    parent = {r["pid"]: r["ppid"] for r in records}
    charged = collections.Counter()
    for r in records:
        pid, hops = r["ppid"], 0
        while pid not in starts and pid in parent and hops < 32:
            pid, hops = parent[pid], hops + 1
        times = [t for t, _ in starts.get(pid, [])]
        i = bisect.bisect_right(times, r["start"] + 0.999) - 1  # acct start times are whole seconds
        charged[starts[pid][i][1] if pid in starts and i >= 0 else "(not under a test)"] += r["cpu"]
    return charged


def _cpu_split() -> list:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:1 + len(_STAT_FIELDS)]]


def _acct(path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        raise OSError(ctypes.get_errno(), f"acct({path!r}) failed: {os.strerror(ctypes.get_errno())} (needs root)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the result here (also printed)")
    parser.add_argument("--top", type=int, default=40, help="tests and files listed")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        parser.error("needs Linux process accounting")
    work = tempfile.mkdtemp(prefix="suite_cpu_")
    pacct, trace = os.path.join(work, "pacct"), os.path.join(work, "trace.tsv")
    with open(os.path.join(work, "ballast_suite_cpu_plugin.py"), "w") as f:
        f.write(_PLUGIN)
    open(pacct, "wb").close()
    env = dict(os.environ, BALLAST_SUITE_CPU_TRACE=trace,
               PYTHONPATH=os.pathsep.join(p for p in (work, os.environ.get("PYTHONPATH", "")) if p))
    before, started = _cpu_split(), time.time()
    _acct(pacct)
    try:
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "ballast_suite_cpu_plugin", *args.pytest_args],
                               env=env)
    finally:
        _acct(None)
    wall = time.time() - started
    split = {k: (b - a) / 100.0 for k, a, b in zip(_STAT_FIELDS, before, _cpu_split())}
    records = read_accounting(pacct)
    starts = collections.defaultdict(list)
    for line in open(trace) if os.path.exists(trace) else []:
        t, pid, nodeid = line.rstrip("\n").split("\t", 2)
        starts[int(pid)].append((float(t), nodeid))
    for entries in starts.values():
        entries.sort()
    by_test = charge_to_tests(records, starts)
    by_file = collections.Counter()
    for nodeid, cpu in by_test.items():
        by_file[nodeid.split("::", 1)[0]] += cpu
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for r in records:
        by_name[r["comm"]][0] += 1
        by_name[r["comm"]][1] += r["cpu"]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(),
        "cores": os.cpu_count(), "pytest_exit_code": code, "wall_s": round(wall, 1), "machine_cpu_s": split,
        "processes": len(records), "process_cpu_s": round(sum(r["cpu"] for r in records), 1),
        "by_process_name": {k: {"processes": n, "cpu_s": round(c, 1)}
                            for k, (n, c) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]},
        "by_file_cpu_s": {k: round(v, 1) for k, v in by_file.most_common(args.top)},
        "by_test_cpu_s": {k: round(v, 1) for k, v in by_test.most_common(args.top)},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
