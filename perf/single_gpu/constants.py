"""The bench's fixed choices: its sections, sizes, shapes and budget shares, the impl names its rows
carry, issue 8's goals."""

from __future__ import annotations

SECTIONS = (
    "launch",
    "flag",
    "control",
    "copy",
    "fanout",
    "sweep",
    "reduce",
    "reduce_sweep",
    "relay",
    "lb_prefetch",
    "copy_engine",
)
MiB = 1 << 20
FANOUT_BYTES = 64 * MiB
CE_RESERVE_S = 30.0  # of --budget-s, kept for the copy_engine section
LB_RESERVE_S = 30.0  # of --budget-s, kept for the lb_prefetch section by the sections before it
# DeepEP's lb_prefetch_weights test shape (tests/ep/test_prefetch_weights.py at deepseek-ai/DeepEP 1a1ffbac: 8
# ranks, 64 experts, 8 redundant slots, 64 MiB weights + 16 KiB + 4 KiB scale factors per expert, 25% empty,
# random mapping): (world, experts per rank, slots per rank), the members (name, bytes per expert, dtype name),
# the empty share and the mapping's seed
LB_SHAPE = (8, 8, 8)
LB_MEMBERS = (("weights", 64 * MiB, "float8_e4m3fn"), ("sf0", 16 << 10, "float32"), ("sf1", 4 << 10, "float32"))
LB_EMPTY, LB_SEED = 0.25, 0
LB_PER_GRAPH, LB_REPLAYS = 2, 5  # graph-replayed lb_prefetch rows: a few large operations per graph
# the lb_prefetch rows' impls: DeepEP's way (a direct push, one copy per slot and tensor), ultracomm's
# multicast of one 3-member layout, and the deepep_lb adapter's own calls
LB_COPIES, LB_MULTICAST, LB_ADAPTER = "copy_ per (slot, tensor)", "tile mover, 3-member layout", "deepep_lb.LBBuffer"
# the reduce rows' impl per reduce path of the tile mover (ULTRACOMM_REDUCE_PATH): the register hunks keep
# the rows' historical name
REDUCE_IMPLS = {"hunk": "tile mover", "tma": "tile mover tma-staged"}
GOAL_COPY, GOAL_COPY_SMS, GOAL_REDUCE = 0.90, 16, 0.85
SENTINEL = 0xA5
# control plane shapes (label, world, experts per rank): EP8 .. EP288 loopback worlds on one GPU
CONTROL_SHAPES = (("EP8", 8, 32), ("EP16", 16, 16), ("EP64", 64, 4), ("EP288", 288, 2))
# graph-replayed timing: an operation captured PER_GRAPH times into one CUDA graph, REPLAYS replays
CONTROL_PER_GRAPH, CONTROL_REPLAYS = 10, 20
LAUNCH_PER_GRAPH, LAUNCH_REPLAYS = 100, 10
# the control kernels of one layer and micro-batch: (row case suffix, impl), in stream order
CONTROL_KERNELS = (
    ("exchange", "k_load_exchange"),
    ("plan", "k_quota"),
    ("build", "k_build_slot"),
    ("reroute", "k_reroute"),
)
CONTROL_STEP = ("exchange+plan+build+reroute", "device step")
# the same step's graph with programmatic dependent launch (csrc/cuda/pdl.h, sm_90+): same case,
# its own impl; the other control rows run without it (key "pdl" in control_graph_rows' dicts)
CONTROL_STEP_PDL = ("pdl", "device step, PDL")
