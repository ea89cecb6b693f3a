"""The planner evaluation's cases (``python -m ultracomm.tools.planner_eval``): planners, load
shapes, targets, and the row each (case, load, planner) gives."""

from __future__ import annotations

from dataclasses import dataclass

NAMES = ("quota", "taot", "greedy", "lpt")
IMBALANCES = (0.10, 0.20, 0.30, 0.50, 0.70)
ZIPF_TARGETS = (1.51, 2.01, 3.03)
BLOCKED_TARGETS = (1.5, 2.0, 3.0)
HOT_FRACTIONS = (0.30, 0.50, 0.70, 0.90)
INTER_WEIGHT = 3.0
# (label, nodes, gpus per node, model, fabric)
TAOT_CASES = (("EP16", 2, 8, "qwen3-235b-a22b", "2x8-rdma"), ("EP32", 4, 8, "deepseek-v3", "4x8-rdma"))
EP64 = ("EP64", 64, "deepseek-v3", "nvl72")  # 256 experts, 4 per rank
K = 2
TOKENS_PER_RANK = 8192


@dataclass
class Row:
    case: str
    load: str
    planner: str
    before: float  # max:mean before
    after: float  # max:mean after
    intra: int
    inter: int
    weighted: float
    plan_ms: float  # median
    min_ms: float  # fastest call
    max_ms: float  # slowest call
    sync_ms: float | None  # simulated weight_sync makespan
    pred_ms: float | None  # schedule stats predicted_s
    replicas: int
