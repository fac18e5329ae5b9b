"""Tools: the calculator's exactness and bounds, the sandbox's limits, schemas and the yaml loader."""

import asyncio
import time

import pytest

from ballast.tools import (CalculatorTool, PythonExpressionTool, Tool, ToolError, check_arguments, check_schema,
                           load_tools)
from ballast.tools.calculator import evaluate, format_number
from ballast.tools.sandbox import run_expression


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
    async def run(expr, **kw):  # a generous limit: a loaded box can take seconds to start an interpreter
        return await run_expression(expr, **{"timeout_s": 30, "memory_bytes": 128 << 20, **kw})

    ok = asyncio.run(run("sum(range(10)) * math.pi"))
    assert not ok.failed and ok.text.startswith("141.37")
    start = time.perf_counter()
    slow = asyncio.run(run("sum(i for i in range(10**12))", timeout_s=1))
    assert slow.timed_out and time.perf_counter() - start < 4
    assert "MemoryError" in asyncio.run(run("[0] * (10 ** 9)")).text
    big = asyncio.run(run("'z' * (10 ** 6)", max_output_bytes=1000))
    assert big.truncated and len(big.output) == 1000
    for escape in ("().__class__.__bases__", "open('/etc/passwd').read()", "__import__('os').system('true')"):
        result = asyncio.run(run(escape))
        assert result.failed, escape
    tool = PythonExpressionTool({"timeout_s": 30})  # the interpreter start-up alone can take over 1 s on a loaded box
    assert asyncio.run(tool.execute("i", {"expression": "1/0"})).error == "exception"


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
    for text, why in [("tools: 3", "top-level 'tools:' list"), ("tools:\n  - class_name: nope.Tool", "cannot import"),
                      ("tools:\n  - class_name: calculator\n  - class_name: calculator", "second tool named"),
                      ("tools:\n  - class_name: calculator\n    config: {type: mcp}", "only 'native'"),
                      ("tools:\n  - class_name: builtins.dict", "not a ballast.tools.Tool")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_tools(str(path))
    with pytest.raises(ValueError, match="is not a file"):
        load_tools(str(tmp_path / "missing.yaml"))
    assert issubclass(CalculatorTool, Tool)
