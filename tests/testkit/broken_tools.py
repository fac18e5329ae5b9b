"""A tool that cannot start: its constructor raises what a real tool's might (a missing service)."""

from ballast.tools import Tool


class UnreachableServiceTool(Tool):
    def __init__(self, config=None, tool_schema=None):
        raise ConnectionError("the verifier service at 127.0.0.1:9 refused the connection")
