"""benchmarks/suite_cpu.py's pure parts: kernel accounting records read back, and each process charged
to the test that was running on the pytest worker it descends from when it started."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "suite_cpu.py"
_spec = importlib.util.spec_from_file_location("suite_cpu", SCRIPT)
suite_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_cpu)


def _record(comm, pid, ppid, start, utime_ticks, stime_ticks):
    return suite_cpu._RECORD.pack(0, 3, 0, 0, 0, 0, pid, ppid, start, 0.0, utime_ticks, stime_ticks,
                                  0, 0, 0, 0, 0, 0, comm.encode())


def test_records_read_back_with_comp_t_times(tmp_path):
    path = tmp_path / "pacct"
    # comp_t: 13-bit mantissa, base-8 exponent; 0x2000 | 100 is 100 * 8 ticks = 8 s
    path.write_bytes(_record("ray::ActorRollo", 11, 10, 1000, 250, 0x2000 | 100))
    [rec] = suite_cpu.read_accounting(str(path))
    assert rec == {"comm": "ray::ActorRollo", "pid": 11, "ppid": 10, "start": 1000, "cpu": 2.5 + 8.0}


def test_each_process_is_charged_to_the_test_running_on_its_ancestor_worker():
    records = [
        {"comm": "raylet", "pid": 20, "ppid": 1, "start": 99, "cpu": 1.0},     # the worker's Ray: no test ancestor
        {"comm": "raylet", "pid": 21, "ppid": 7, "start": 100, "cpu": 2.0},    # started by worker 7 during test a
        {"comm": "ray::A", "pid": 22, "ppid": 21, "start": 105, "cpu": 5.0},   # grandchild, during test b
        {"comm": "python", "pid": 23, "ppid": 8, "start": 104, "cpu": 3.0},    # worker 8's test c
        {"comm": "python", "pid": 24, "ppid": 8, "start": 98, "cpu": 0.5},     # before worker 8's first test
    ]
    starts = {7: [(99.5, "t::a"), (104.2, "t::b")], 8: [(103.0, "u::c")]}
    charged = suite_cpu.charge_to_tests(records, starts)
    assert charged == {"(not under a test)": 1.5, "t::a": 2.0, "t::b": 5.0, "u::c": 3.0}
