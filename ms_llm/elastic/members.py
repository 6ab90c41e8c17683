"""Which nodes of a multi-node job are still there.

Every node's supervisor rewrites <run>/elastic/node<ID>.alive (the run folder is shared) every
BEAT_S; ID is the node's rank at the first launch, its name for the whole job. After a failure
each survivor keeps beating for NODE_TIMEOUT_S + BEAT_S, so that a node that is gone (its
supervisor killed, its machine lost) has a stale file on every survivor's view, then takes the
nodes with fresh files, in ID order, as the new node list:

    nodes 0, 1, 2; node 1 lost  ->  node 0 is rank 0, node 2 is rank 1 of 2; master: node 0's address

Every survivor sees the same list and counts the same restarts, so all pick the same node ranks,
master and port (the first port + the restart count: the previous one may linger in TIME_WAIT).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ms_llm.nodes import Nodes

BEAT_S = 0.5
NODE_TIMEOUT_S = 3.0


@dataclass
class Membership:
    folder: Path                  # <run>/elastic
    node_id: int
    address: str                  # where this node's agent can host the rendezvous
    last: float = 0.0

    def beat(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last < BEAT_S:
            return
        self.last = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"node{self.node_id}.alive"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"node": self.node_id, "addr": self.address, "time": time.time()}))
        os.replace(tmp, path)

    def alive(self) -> list[dict]:
        found = []
        for path in self.folder.glob("node*.alive"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if time.time() - float(record.get("time", 0)) <= NODE_TIMEOUT_S:
                found.append(record)
        return sorted(found, key=lambda r: int(r["node"]))

    def survivors(self, first: Nodes, restarts: int) -> Nodes:
        """Wait out the node timeout (beating), then the node list every survivor agrees on."""
        deadline = time.monotonic() + NODE_TIMEOUT_S + BEAT_S
        while time.monotonic() < deadline:
            self.beat()
            time.sleep(0.05)
        members = self.alive()
        ids = [int(m["node"]) for m in members]
        if len(ids) <= 1:
            return Nodes()
        return Nodes(count=len(ids), rank=ids.index(self.node_id), master_addr=members[0]["addr"],
                     master_port=first.master_port + restarts)
