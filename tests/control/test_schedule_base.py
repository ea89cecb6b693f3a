"""Issue 36: Schedule and PortableSchedule share one base (ultracomm.schedule_base): the same
interface, and the JSON export written once for both."""

from __future__ import annotations

import json

import numpy as np

from ultracomm import ReplicaPlan
from ultracomm.records import Op
from ultracomm.schedule import Schedule, build_schedule
from ultracomm.schedule_base import ScheduleBase
from ultracomm.schedule_portable import PortableSchedule, build_schedule_portable


def test_both_builders_export_the_same_shape_of_json():
    plan = ReplicaPlan.make(np.array([[2, -1], [0, 4], [0, 1]], np.int32), experts_per_rank=2)
    host = build_schedule(plan, 4096, 8192, chunk_bytes=1024)
    portable = build_schedule_portable(plan, 4096, 8192, chunk_bytes=1024, rank=1)
    assert isinstance(host, Schedule) and isinstance(portable, PortableSchedule)
    for s in (host, portable):
        assert isinstance(s, ScheduleBase)
        out = json.loads(s.to_json())
        assert out["digest"] == s.digest and set(out["ops"]) == {"multicast", "reduce"}
        built = [str(r) for r in range(s.world)] if s.built_for is None else [str(s.built_for)]
        for op in (Op.MULTICAST, Op.REDUCE):
            o = out["ops"][op.name.lower()]
            assert sorted(o["tasks"]) == sorted(built)
            assert o["tree"]["parent_rank"] == s.tree(op)[0].tolist()
            assert [t["bytes"] for t in o["tasks"]["1"]] == s.tasks(op, 1)["bytes"].tolist()
            assert o["refs"]["1"] == [[int(x["rank"]), int(x["slot"])] for x in s.refs(op, 1)]
    # the two builders agree on the trees' depth and the work rank 1 does, not on the digest
    for op in (Op.MULTICAST, Op.REDUCE):
        assert host.tasks(op, 1)["bytes"].sum() == portable.tasks(op, 1)["bytes"].sum()
