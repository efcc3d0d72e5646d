"""Defaults from SLURM: under ``srun`` with one meshrun per node, no endpoint needs typing.

When meshrun runs as a SLURM job step (``SLURM_STEP_ID`` set) with one task per node and the
user gave no ``--rdzv-endpoint``, it takes the node count (``SLURM_STEP_NUM_NODES``, else
``SLURM_NNODES``), this node's rank (``SLURM_NODEID``) and the first host of the node list
(``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``) as the c10d rendezvous host, and the
job id as the run id. Node lists are expanded here (``gpu[01-03,7],cpu5`` ->
``gpu01 gpu02 gpu03 gpu7 cpu5``), without shelling out to ``scontrol``.

The port is the job's own, 20000 + job id mod 10000 (`SlurmDefaults.port`), not one fixed
port: nodes are shared between jobs (select/cons_tres, ``--oversubscribe``, the tasks of a job
array), and two jobs whose first node is the same would otherwise both aim at
``first_host:29400``. The second job's agent there could not bind it, connected to the first
job's store instead, and lost it, exit 3, when that job ended (seen on a real cluster with a
two-node ``--array=0-1 --oversubscribe``). Job ids that run side by side are close, so they
get different ports. For the same reason the host is decided by the node rank (node 0 of the
step hosts, ``is_host``), not by "the first agent to bind": a port that is taken anyway is
one line and exit 3 on node 0, never another job's store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class SlurmDefaults:
    """What a SLURM step says about the job: node count, this node's rank, the first host."""

    num_nodes: int
    node_rank: int
    first_host: str
    job_id: str

    @property
    def port(self) -> int:
        """The job's rendezvous port: 20000 + job id mod 10000 (below Linux's ephemeral range,
        32768 and up, so never a port the OS hands out; jobs 10000 ids apart share it)."""
        return PORT_BASE + int(self.job_id) % PORT_SPAN if self.job_id.isdigit() else 29400

    def note(self) -> str:
        return (
            f"note: SLURM job {self.job_id}: node rank {self.node_rank} of {self.num_nodes}, "
            f"c10d rendezvous at {self.first_host}:{self.port} (from SLURM_NODEID, the node "
            "list and the job id)"
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``a[1-3,05],b`` -> ``["a1", "a2", "a3", "a05", "b"]``.

    Ranges keep their zero padding (``[01-03]`` -> 01, 02, 03), as SLURM does.

    Raises:
        ValueError: unbalanced brackets or a malformed range.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    results = []
    for part in match.group(1).split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM node list entry {item!r}: bad range {part!r}")
        numbers = range(int(lo), int(hi or lo) + 1)
        results.extend(f"{head}{str(n).zfill(len(lo))}" for n in numbers)
    return [host for r in results for host in _expand_one(r + tail)]


def slurm_defaults(env: Mapping[str, str]) -> SlurmDefaults | None:
    """The SLURM step's defaults, or None when not under ``srun`` with one task per node."""
    if "SLURM_STEP_ID" not in env or "SLURM_NODEID" not in env:
        return None
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or num_nodes)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if tasks != num_nodes or not nodelist:
        return None  # several meshruns per node, or no node list: leave it to the user
    hosts = expand_nodelist(nodelist)
    return SlurmDefaults(
        num_nodes=num_nodes,
        node_rank=int(env["SLURM_NODEID"]),
        first_host=hosts[0],
        job_id=env.get("SLURM_JOB_ID", "slurm"),
    )
