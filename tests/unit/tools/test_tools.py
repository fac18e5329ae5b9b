"""Tools: the calculator's exactness and bounds, the sandbox's limits and failing closed, the code
interpreter's answers, schemas and the yaml loader."""

import asyncio
import time

import pytest

from ballast.tools import (CalculatorTool, CodeInterpreterTool, PythonExpressionTool, Sandbox, SandboxLimits,
                           SandboxUnavailableError, Tool, ToolCall, ToolError, ToolExecutor, check_arguments,
                           check_schema, load_tools)
from ballast.tools.calculator import evaluate, format_number


@pytest.mark.parametrize("expr, value", [("123456789 * 987654321", 121932631112635269), ("7 / 2", 3.5),
                                         ("(2 + 3) * -4", -20), ("2 ^ 10", 1024), ("17 // 5 + 17 % 5", 5)])
def test_calculator_is_exact(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [("9 ** 9 ** 9", "exponent"), ("__import__('os')", "only numbers"),
                                       ("1 / 0", "division by zero"), ("10 ** 60 * 10 ** 60 * 10 ** 60 * 10 ** 60",
                                                                       "exceeds 200 digits"),
                                       ("1 +", "cannot parse"), ("x" * 300, "at most 200")])
def test_calculator_refuses_with_a_reason(expr, why):
    with pytest.raises(ToolError, match=why):
        evaluate(expr)


def test_calculator_formats_whole_quotients_as_integers():
    assert format_number(evaluate("10 / 2")) == "5" and format_number(evaluate("1 / 4")) == "0.25"
    assert asyncio.run(CalculatorTool().execute("i", {"expression": "6 * 7"})).text == "42"


def test_sandbox_limits_time_memory_output_and_escapes():
    # generous limits: a loaded box can take seconds to start an interpreter
    sandbox = Sandbox(SandboxLimits(timeout_s=30, memory_bytes=128 << 20, max_output_bytes=1000), owner="test")
    ok = sandbox.run_sync("import math\nprint(sum(range(10)) * math.pi)")
    assert ok.ok and ok.isolated and ok.text().startswith("141.37")
    start = time.perf_counter()
    slow = sandbox.run_sync("while True: pass", timeout_s=1)
    assert slow.reason == "timeout" and time.perf_counter() - start < 4
    assert sandbox.run_sync("x = bytearray(10 ** 9)").reason == "memory"
    big = sandbox.run_sync("print('z' * 10 ** 6)")
    assert big.reason == "output_limit" and big.truncated and len(big.stdout) == 1000
    echo = sandbox.run_sync("import sys\nprint(sys.stdin.read()[::-1], file=sys.stderr)\nraise SystemExit(3)", "abc")
    assert (echo.stderr, echo.exit_code, echo.reason) == (b"cba\n", 3, "exit_status")
    tool = PythonExpressionTool({"timeout_s": 30})
    assert asyncio.run(tool.execute("i", {"expression": "1/0"})).error == "exception"
    for escape in ("().__class__.__bases__", "open('/etc/passwd').read()", "__import__('os').system('true')"):
        assert asyncio.run(tool.execute("i", {"expression": escape})).error == "exception", escape


def test_tools_that_run_code_refuse_to_start_without_the_sandbox(tmp_path):
    missing = str(tmp_path / "no-bwrap")
    for cls, name in ((PythonExpressionTool, "python"), (CodeInterpreterTool, "code_interpreter")):
        with pytest.raises(SandboxUnavailableError, match=f"tool '{name}'.*bwrap binary.*unsafe: true"):
            cls({"bwrap_path": missing})
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: code_interpreter\n    config: {{type: native, bwrap_path: {missing}}}\n")
    with pytest.raises(ValueError, match=r"tools.yaml tools\[0\]: tool 'code_interpreter' .*bwrap binary"):
        load_tools(str(path))
    with pytest.raises(ValueError, match="unsafe='yes' must be true or false"):
        CodeInterpreterTool({"unsafe": "yes"})
    with pytest.raises(ValueError, match="default_language='cpp': only python"):
        CodeInterpreterTool({"default_language": "cpp"})
    with pytest.raises(ValueError, match="sandbox_fusion_url is verl's remote sandbox service"):
        CodeInterpreterTool({"sandbox_fusion_url": "http://localhost:8080/run_code"})


def test_unsafe_runs_without_isolation_loudly(tmp_path, caplog, capsys):
    with caplog.at_level("WARNING"):
        tool = CodeInterpreterTool({"unsafe": True, "bwrap_path": str(tmp_path / "no-bwrap"), "timeout_s": 30})
    assert "WITHOUT the OS-level sandbox" in caplog.text and "without isolation" in capsys.readouterr().err
    response = asyncio.run(tool.execute("i", {"code": "print(1 + 1)"}))
    assert response.text == "2\n" and response.metrics["sandbox_unsafe"] == 1.0


def test_code_interpreter_reports_stdout_stderr_and_how_it_ended():
    tool = CodeInterpreterTool({"timeout_s": 30, "max_output_bytes": 4096})
    executor = ToolExecutor({tool.name: tool}, max_response_length=64, truncate_side="right")
    program = "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(2)"
    [call] = asyncio.run(executor.run_turn([ToolCall("code_interpreter", {"code": program})]))
    assert (call.text, call.error) == ("out\nerr\nexit status 2", "exception")
    [long] = asyncio.run(executor.run_turn([ToolCall("code_interpreter", {"code": "print('y' * 500)"})]))
    assert long.text == "y" * 64 + "...(truncated)" and long.error is None  # max_tool_response_length
    crash = asyncio.run(tool.execute("i", {"code": "1/0"}))
    assert crash.text.startswith('Traceback (most recent call last):\n  File "/sandbox/main.py", line 1')
    assert "ZeroDivisionError" in crash.text and "runner" not in crash.text  # it starts at the model's program
    assert asyncio.run(tool.execute("i", {"code": ""})).text == "(no output)"
    with pytest.raises(ToolError, match="at most 20000"):
        asyncio.run(tool.execute("i", {"code": "#" * 20001}))


def test_schemas_and_arguments_are_checked():
    schema = CalculatorTool().schema
    assert check_arguments(schema, {"expression": "1"}) is None
    assert "missing" in check_arguments(schema, {})
    assert "must be string" in check_arguments(schema, {"expression": 1})
    assert "must be a JSON object" in check_arguments(schema, [1])
    with pytest.raises(ValueError, match="unknown type"):
        check_schema({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "complex"}}}}}, "here")
    with pytest.raises(ValueError, match="required parameters"):
        check_schema({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {}, "required": ["a"]}}}, "here")


def test_tool_yaml_loading(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n    config: {type: native, timeout_s: 2}\n"
                    "  - class_name: ballast.tools.python_expr.PythonExpressionTool\n    config: {type: native}\n")
    tools = load_tools(str(path))
    assert sorted(tools) == ["calculator", "python"] and tools["calculator"].timeout_s == 2
    path.write_text("tools:\n  - class_name: code_interpreter\n    config: {type: native, default_timeout: 3, "
                    "memory_limit_mb: 64}\n")  # verl's names for the two limits
    interpreter = load_tools(str(path))["code_interpreter"]
    assert (interpreter.limits.timeout_s, interpreter.limits.memory_bytes) == (3, 64 << 20)
    for text, why in [("tools: 3", "top-level 'tools:' list"), ("tools:\n  - class_name: nope.Tool", "cannot import"),
                      ("tools:\n  - class_name: calculator\n  - class_name: calculator", "second tool named"),
                      ("tools:\n  - class_name: calculator\n    config: {type: mcp}", "only 'native'"),
                      ("tools:\n  - class_name: builtins.dict", "not a ballast.tools.Tool")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_tools(str(path))
    with pytest.raises(ValueError, match="is not a file"):
        load_tools(str(tmp_path / "missing.yaml"))
    path.write_text("tools:\n  - class_name: calculator\n  - class_name: testkit.broken_tools.UnreachableServiceTool\n")
    with pytest.raises(ValueError, match=r"tools\.yaml tools\[1\]: testkit\.broken_tools\.UnreachableServiceTool raised "
                                         r"ConnectionError while starting: the verifier service at 127\.0\.0\.1:9"):
        load_tools(str(path))
    assert issubclass(CalculatorTool, Tool)
