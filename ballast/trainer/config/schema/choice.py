"""Typed choices of the schema: string Enums that OmegaConf validates when the config is loaded.

OmegaConf 2.3 accepts Enum-typed fields (it rejects `typing.Literal`) and looks a member up by its
NAME, so every member here is named exactly as the string a user writes (`token-mean`, `async`),
which the functional Enum API allows where class syntax would not. A member is a `str` that prints,
formats and compares as its value, so code downstream handles it as the plain string. A bad value is
a `ConfigError` from the loader: `<key>='<value>' is not one of '<a>', '<b>'`.
"""

from __future__ import annotations

from enum import Enum
from typing import Type


class Choice(str, Enum):
    """Base of every choice type; use `choice(...)` to make one."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choice(name: str, module: str, *values: str) -> Type[Choice]:
    """A `Choice` subclass called `name` (defined in `module`, so it pickles) with one member per value."""
    return Choice(name, [(v, v) for v in values], module=module, qualname=name)


def values(kind: Type[Choice]) -> tuple:
    """The strings `kind` accepts, in declaration order."""
    return tuple(member.value for member in kind)
