"""`@register`: declares how a worker method's arguments are split across a worker group and how the
results come back. The worker group reads these attributes and builds one driver-side method each.

Dispatch modes:
* `ONE_TO_ALL`: every worker gets the same arguments; results are returned as a list in rank order.
* `ALL_TO_ALL`: each argument is a list with one entry per worker.
* `DP_COMPUTE_PROTO`: Batch arguments are cut into world-size chunks (rank r gets chunk r), results
  are concatenated in rank order. Not divisible is an error naming the sizes, unless `pad=True`: then
  the Batch is padded, and the padding is removed from the result.
* `MESH`: mesh-aware DP: the Batch is cut into dp-size chunks for the method's `mesh` role; every
  worker of one dp rank (its SP/TP peers) gets the SAME chunk, put into the object store once; results
  come only from each dp rank's collect worker, in dp order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

MAGIC_ATTR = "_ballast_register"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    MESH = "mesh"


class Execute(enum.Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class Registration:
    dispatch: Dispatch
    execute: Execute
    blocking: bool
    mesh: Optional[str]
    pad: bool


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, execute_mode: Execute = Execute.ALL,
             blocking: bool = True, mesh: Optional[str] = None, pad: bool = False) -> Callable:
    """Mark a worker method as a group method (see the module docstring for the modes)."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, got {execute_mode!r}")
    if (dispatch_mode is Dispatch.MESH) != (mesh is not None):
        raise ValueError("mesh=<role> is required with Dispatch.MESH and only allowed with it")
    if pad and dispatch_mode not in (Dispatch.DP_COMPUTE_PROTO, Dispatch.MESH):
        raise ValueError(f"pad=True only applies to Batch-splitting modes, not {dispatch_mode.name}")
    if execute_mode is Execute.RANK_ZERO and dispatch_mode is not Dispatch.ONE_TO_ALL:
        raise ValueError("Execute.RANK_ZERO only makes sense with Dispatch.ONE_TO_ALL")
    info = Registration(dispatch_mode, execute_mode, blocking, mesh, pad)

    def mark(fn: Callable) -> Callable:
        setattr(fn, MAGIC_ATTR, info)
        return fn

    return mark


def registration_of(fn) -> Optional[Registration]:
    return getattr(fn, MAGIC_ATTR, None)
