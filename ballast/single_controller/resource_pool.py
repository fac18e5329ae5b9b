"""Resource pools: one placement group per node, one bundle per device, in a stable rank order.

Bundles are {GPU: 1, CPU: c} on GPU machines and {CPU: c} on CPU machines (one per worker process).
Placement groups are STRICT_PACK (a node's bundles stay on that node) and, once placed, are ordered
by node IP address, so rank r lands on the same node across restarts and on multi-node clusters.
Several worker groups can share a pool: each takes a fraction (`device_share`) of every bundle.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ballast.single_controller.errors import PlacementError


@dataclass(frozen=True)
class Slot:
    """One device's bundle: where worker `rank` of every group on this pool runs."""

    rank: int
    placement_group: object
    bundle_index: int
    node_id: str
    node_ip: str
    local_rank: int


def _ip_key(ip: str):
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


class ResourcePool:
    """Devices (or CPU worker slots) on `len(process_on_nodes)` nodes."""

    def __init__(self, process_on_nodes: Sequence[int], use_gpu: bool, cpus_per_process: float = 1.0,
                 name: str = "ballast", ready_timeout_s: float = 60.0) -> None:
        if not process_on_nodes or any(int(n) < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes={list(process_on_nodes)} must be a non-empty list of counts >= 1")
        if cpus_per_process <= 0:
            raise ValueError(f"cpus_per_process={cpus_per_process} must be > 0")
        self.process_on_nodes = [int(n) for n in process_on_nodes]
        self.use_gpu = use_gpu
        self.cpus_per_process = float(cpus_per_process)
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self._slots: Optional[List[Slot]] = None
        self._pgs: List[object] = []

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> Dict[str, float]:
        return {"CPU": self.cpus_per_process, "GPU": 1.0} if self.use_gpu else {"CPU": self.cpus_per_process}

    def slots(self) -> List[Slot]:
        """Create the placement groups on first use and return the slots in rank order."""
        if self._slots is None:
            self._slots = self._place()
        return self._slots

    def _place(self) -> List[Slot]:
        bundle = self.bundle()
        pgs = [placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"{self.name}_node{i}")
               for i, n in enumerate(self.process_on_nodes)]
        self._pgs = pgs
        ready, pending = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
        if pending:
            self.remove()
            raise PlacementError(
                f"resource pool {self.name!r} needs {len(self.process_on_nodes)} node(s) with "
                f"{self.process_on_nodes} bundles of {bundle}, but only {len(ready)} placement group(s) could be "
                f"placed within {self.ready_timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
            )
        ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        placed = []
        for pg in pgs:
            node_id = placement_group_table(pg)["bundles_to_node_id"][0]
            placed.append((_ip_key(ip_of.get(node_id, "")), node_id, pg))
        placed.sort(key=lambda item: (item[0], item[1]))
        slots, rank = [], 0
        for _, node_id, pg in placed:
            for index in range(len(pg.bundle_specs)):
                slots.append(Slot(rank, pg, index, node_id, ip_of.get(node_id, ""), index))
                rank += 1
        return slots

    def remove(self) -> None:
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # already gone with the cluster: nothing left to free
                pass
        self._pgs, self._slots = [], None
