"""Code-execution rewards: run the model's program against hidden test cases inside the OS-level sandbox.

The data follows verl's code tasks: `reward_model.ground_truth` holds the test cases, as a dict or its
JSON text, in one of verl's shapes:

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}             # stdin -> expected stdout
    {"fn_name": "f", "inputs": ["3", ...], "outputs": ["10", ...]}  # call f(*args): one JSON arg per input line
    {"assert_case": ["assert f(3) == 10", ...]}                     # appended to the program; passes if it exits 0

The program is the last ```python block of the response (else the first ``` block); a response without
one scores 0 (`no_code`). Each test case is one sandboxed execution (`ballast.tools.sandbox`: no network,
no host files, uid 65534, time/memory/process/output limits) with its own time limit `test_timeout_s`;
at most `max_concurrency` run at once in the whole process. Output is compared as verl does (trailing
newlines stripped); with `fn_name` the printed JSON value is compared with the expected JSON value.

`mode`: "pass_rate" (score = passed / tests) or "all_pass" (1.0 only if every test passes; the first
failure stops the remaining tests). Besides "score" the result records `pass_rate`, `tests_passed`,
`no_code`, `wrong_answers`, `runtime_errors`, `timeouts`, `resource_limits`, `sandbox_errors` and
`sandbox_unsafe`, so the step's metrics say why programs failed. Nothing a program does raises: a
hostile program scores 0 and the step goes on.

The data sources "ballast/code" and verl's code sets ("codecontests", "apps", "codeforces", "taco") are
scored by one process-wide `CodeReward` with the defaults below, built when the trainer starts (so a
machine that cannot isolate the code refuses the run before any worker starts). Other settings: point
`custom_reward_function.path` at a file holding e.g.
`compute_score = CodeReward(mode="all_pass", test_timeout_s=1)` (name `compute_score`).
"""

from __future__ import annotations

import functools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ballast.tools.sandbox import Sandbox, SandboxLimits, SandboxResult

DATA_SOURCES = ("ballast/code", "codecontests", "apps", "codeforces", "taco")
MODES = ("pass_rate", "all_pass")
STATUSES = ("passed", "wrong_answer", "runtime_error", "timeout", "resource_limit", "sandbox_error", "skipped")

# Appended to the program for `fn_name` tests: arguments from stdin, one JSON value per line.
_CALL_HARNESS = '''

def _ballast_call_entry():
    import json as _json, sys as _sys
    _args = [_json.loads(_line) for _line in _sys.stdin.read().splitlines() if _line.strip()]
    _fn = globals().get({name!r})
    if _fn is None and isinstance(globals().get("Solution"), type):
        _fn = getattr(globals()["Solution"](), {name!r}, None)
    if _fn is None:
        raise NameError("the program defines no function " + {name!r})
    print(_json.dumps(_fn(*_args), default=str))
_ballast_call_entry()
'''


@dataclass(frozen=True)
class TestCase:
    stdin: str
    expected: str | None
    appended: str = ""


def parse_test_cases(ground_truth) -> tuple[list[TestCase], str | None]:
    """(test cases, fn_name) from verl's test-case dict or its JSON text; ValueError saying what is wrong."""
    cases = ground_truth
    if isinstance(cases, (str, bytes)):
        try:
            cases = json.loads(cases)
        except json.JSONDecodeError as err:
            raise ValueError(f"code ground_truth is not valid JSON: {err}") from None
    if not isinstance(cases, dict):
        raise ValueError(f"code ground_truth must be a dict of test cases, got {type(cases).__name__}")
    asserts = cases.get("assert_case")
    if asserts is not None:
        if not isinstance(asserts, list) or not all(isinstance(a, str) for a in asserts):
            raise ValueError("code ground_truth 'assert_case' must be a list of strings")
        inputs = cases.get("inputs") or [""] * len(asserts)
        outputs = cases.get("outputs") or [None] * len(asserts)
    else:
        inputs, outputs = cases.get("inputs"), cases.get("outputs")
        asserts = [""] * len(inputs or [])
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise ValueError(f"code ground_truth needs non-empty 'inputs' and 'outputs' lists (or 'assert_case'); "
                         f"keys {sorted(cases)}")
    if not len(inputs) == len(outputs) == len(asserts):
        raise ValueError(f"code ground_truth has {len(inputs)} inputs, {len(outputs)} outputs and {len(asserts)} "
                         "assert cases; they must match")
    fn_name = cases.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"code ground_truth 'fn_name' must be a Python identifier, got {fn_name!r}")
    return [TestCase("" if i is None else str(i), None if o is None else str(o), a)
            for i, o, a in zip(inputs, outputs, asserts)], fn_name


def extract_program(completion: str) -> str | None:
    """The last ```python block of `completion`, else its first ``` block (language tag dropped), else None."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    parts = completion.split("```")
    if len(parts) < 3:
        return None
    block = parts[1]
    first, _, rest = block.partition("\n")
    return rest if first.strip().isalpha() else block


def outcome(result: SandboxResult, case: TestCase, fn_name: str | None) -> str:
    """One test's status (see STATUSES) from its sandboxed run."""
    if result.reason == "timeout" or result.reason == "cpu_time":
        return "timeout"
    if result.reason in ("memory", "output_limit", "killed"):
        return "resource_limit"
    if result.reason == "sandbox_error":
        return "sandbox_error"
    if result.reason is not None:
        return "runtime_error"
    if case.expected is None:
        return "passed"
    got = result.text("stdout").rstrip("\n")
    want = case.expected.rstrip("\n")
    if got == want:
        return "passed"
    if fn_name is not None:
        try:
            return "passed" if json.loads(got) == json.loads(want) else "wrong_answer"
        except (json.JSONDecodeError, ValueError):
            return "wrong_answer"
    return "wrong_answer"


class CodeReward:
    """A verl-convention score function that runs programs against test cases (module docstring)."""

    def __init__(self, *, mode: str = "pass_rate", max_concurrency: int = 2, test_timeout_s: float = 2.0,
                 memory_mb: int = 256, max_processes: int = 8, max_output_bytes: int = 1 << 16,
                 unsafe: bool = False, bwrap_path: str | None = None):
        if mode not in MODES:
            raise ValueError(f"code reward mode={mode!r} must be one of {MODES}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"code reward max_concurrency={max_concurrency!r} must be an integer >= 1")
        self.mode, self.max_concurrency = mode, max_concurrency
        limits = SandboxLimits(timeout_s=float(test_timeout_s), memory_bytes=int(memory_mb) << 20,
                               max_processes=int(max_processes), max_output_bytes=int(max_output_bytes))
        self.sandbox = Sandbox(limits, owner="the code-execution reward", unsafe=unsafe, bwrap_path=bwrap_path)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="ballast-code-reward")

    def __call__(self, data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
        cases, fn_name = parse_test_cases(ground_truth)
        program = extract_program(solution_str)
        statuses = ["skipped"] * len(cases) if program is None else self.run_tests(program, cases, fn_name)
        passed = statuses.count("passed")
        pass_rate = passed / len(cases)
        score = pass_rate if self.mode == "pass_rate" else float(passed == len(cases))
        return {"score": score, "pass_rate": pass_rate, "tests_passed": float(passed), "no_code": float(program is None),
                "wrong_answers": float(statuses.count("wrong_answer")),
                "runtime_errors": float(statuses.count("runtime_error")), "timeouts": float(statuses.count("timeout")),
                "resource_limits": float(statuses.count("resource_limit")),
                "sandbox_errors": float(statuses.count("sandbox_error")), "sandbox_unsafe": float(self.sandbox.unsafe)}

    def run_tests(self, program: str, cases: list[TestCase], fn_name: str | None) -> list[str]:
        """Each case's status, in order; in all_pass mode the cases after a failure are "skipped"."""
        stop = threading.Event()

        def one(case: TestCase) -> str:
            if stop.is_set():
                return "skipped"
            source = program + (_CALL_HARNESS.format(name=fn_name) if fn_name else "")
            if case.appended:
                source += "\n\n" + case.appended + "\n"
            status = outcome(self.sandbox.run_sync(source, case.stdin), case, fn_name)
            if status != "passed" and self.mode == "all_pass":
                stop.set()
            return status

        return list(self._pool.map(one, cases))


@functools.lru_cache(maxsize=1)
def default_code_reward() -> CodeReward:
    """The process-wide reward for the code data sources (built once; refuses where it cannot isolate)."""
    return CodeReward()


def check_code_sandbox(data_sources) -> list[str]:
    """The code data sources among `data_sources`; if any, the process-wide reward is built now, so a
    machine that cannot isolate their programs raises SandboxUnavailableError before the run starts."""
    code = sorted(set(data_sources) & set(DATA_SOURCES))
    if code:
        default_code_reward()
    return code


def code_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """The registered score function of DATA_SOURCES: `default_code_reward()` on one response."""
    return default_code_reward()(data_source, solution_str, ground_truth, extra_info)
