"""A calculator tool: exact arithmetic on one expression, evaluated in-process with bounded work.

The expression is parsed with Python's `ast` and only numbers, parentheses, unary +/- and the binary
operators + - * / // % ** are evaluated; names, calls, attributes and everything else are refused.
The work is bounded by construction, which is why it needs no subprocess: at most
`max_expression_chars` characters, powers with an exponent of at most `max_exponent`, and no
intermediate integer longer than `max_digits` digits. Integers stay exact (`123456789 * 987654321`
is 121932631112635269); a division that comes out whole prints as an integer.

Config keys (in the tool yaml's `config`): `max_expression_chars` (200), `max_exponent` (64),
`max_digits` (200), `timeout_s` (optional, see `ballast.tools.base.Tool`).
"""

from __future__ import annotations

import ast
import math
import operator

from ballast.tools.base import Tool, ToolError, ToolResponse

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str, *, max_chars: int = 200, max_exponent: int = 64, max_digits: int = 200):
    """The value of an arithmetic expression (int or float); ToolError saying why it was refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("the expression is empty")
    if len(expression) > max_chars:
        raise ToolError(f"the expression has {len(expression)} characters; at most {max_chars} are allowed")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from None

    def check(value):
        if isinstance(value, int) and abs(value) >= 10 ** max_digits:
            raise ToolError(f"a result exceeds {max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        return value

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise ToolError(f"exponent {right} exceeds {max_exponent}")
            try:
                return check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("the result is too large") from None
        raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, found {type(node).__name__}")

    return walk(tree)


def format_number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorTool(Tool):
    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly, e.g. '123 * 456'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression to evaluate"}},
                "required": ["expression"],
            },
        },
    }

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> ToolResponse:
        value = evaluate(parameters["expression"], max_chars=int(self.config.get("max_expression_chars", 200)),
                         max_exponent=int(self.config.get("max_exponent", 64)),
                         max_digits=int(self.config.get("max_digits", 200)))
        return ToolResponse(text=format_number(value))
