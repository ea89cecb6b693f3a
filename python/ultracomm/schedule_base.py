"""What every schedule is: per-rank task lists of both operations, their trees and stats.

:class:`~ultracomm.schedule.Schedule` (the host builder, every rank's lists) and
:class:`~ultracomm.schedule_portable.PortableSchedule` (the device control plane's builder run on
the host, one rank's lists) are executed alike; executors, Context and the tools read them
through this interface.
"""

from __future__ import annotations

import abc
import json
from typing import Optional, Union

import numpy as np

from .records import TASK_DTYPE, Op

__all__ = ["ScheduleBase", "OpLike"]

OpLike = Union[Op, int, str]


class ScheduleBase(abc.ABC):
    """Per-rank task lists of multicast and reduce, their trees, stats and digest."""

    # -- identity -------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def digest(self) -> int:
        """64-bit digest of the inputs and the trees: equal on every rank for the same plan and builder."""

    @property
    @abc.abstractmethod
    def built_for(self) -> Optional[int]:
        """The only rank whose task lists were generated, or None for all ranks."""

    @property
    @abc.abstractmethod
    def world(self) -> int: ...

    @property
    @abc.abstractmethod
    def slots_per_rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_experts(self) -> int: ...

    @property
    @abc.abstractmethod
    def chunk_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def weight_chunks(self) -> int: ...

    @property
    @abc.abstractmethod
    def grad_chunks(self) -> int: ...

    @abc.abstractmethod
    def inputs(self) -> dict:
        """The builder's inputs (plan, bytes, chunk, topology)."""

    # -- task lists -----------------------------------------------------------------------
    @abc.abstractmethod
    def tasks(self, op: OpLike, rank: int) -> np.ndarray:
        """``TASK_DTYPE`` list of ``rank`` (empty for ranks not built)."""

    @abc.abstractmethod
    def refs(self, op: OpLike, rank: int) -> np.ndarray:
        """``REF_DTYPE`` refs of ``rank`` (its tasks index into them)."""

    @abc.abstractmethod
    def tree(self, op: OpLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(parent_rank, parent_slot, depth)``, each int32 ``[world, slots]``."""

    @abc.abstractmethod
    def stats(self, op: Optional[OpLike] = None) -> dict:
        """Stats of one op, or ``{"multicast": ..., "reduce": ...}`` when op is None."""

    # -- export ---------------------------------------------------------------------------
    def to_json(self, indent: Optional[int] = None) -> str:
        """Inputs, trees, stats and task lists (all built ranks) as a JSON string."""
        out: dict = {"digest": self.digest, "built_for": self.built_for, "inputs": _plain(self.inputs()), "ops": {}}
        ranks = range(self.world) if self.built_for is None else [self.built_for]
        for op in (Op.MULTICAST, Op.REDUCE):
            pr, ps, d = self.tree(op)
            tasks = {}
            refs = {}
            for r in ranks:
                t = self.tasks(op, r)
                tasks[str(r)] = [{k: int(row[k]) for k in TASK_DTYPE.names} for row in t]
                refs[str(r)] = [[int(x["rank"]), int(x["slot"])] for x in self.refs(op, r)]
            out["ops"][op.name.lower()] = {
                "tree": {
                    "parent_rank": np.asarray(pr).tolist(),
                    "parent_slot": np.asarray(ps).tolist(),
                    "depth": np.asarray(d).tolist(),
                },
                "stats": _plain(self.stats(op)),
                "tasks": tasks,
                "refs": refs,
            }
        return json.dumps(out, indent=indent)


def _plain(x):
    """``x`` with numpy arrays and scalars as lists and Python numbers (JSON-ready)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x
