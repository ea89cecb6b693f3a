"""``python -m ultracomm.sim``: one case, the calibration, the goal sweep or a sensitivity grid."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

from ..errors import reason
from . import calibration, goal_sweep as goals_mod, sensitivity_grid as sens
from .compare import HDR, fmt_row, grad_dtypes, run_case, table
from .fabric import get_fabric
from .hardware import default_profile


def _floats(s: str) -> list[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not v or any(x < 1 for x in v):
        raise argparse.ArgumentTypeError(f"imbalances must be >= 1, got {s!r}")
    return v


def _size(s: str) -> int:
    """argparse type for byte sizes: :func:`ultracomm.env.parse_size` (``1M``, ``256K``)."""
    from ..env import parse_size

    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(reason(e)) from None


def _dtypes(s: str) -> tuple[str, ...]:
    try:
        return grad_dtypes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(reason(e)) from None


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def _sensitivity_text(res: dict) -> str:
    rows = []
    for d, s in res.items():
        for x in s["settings"]:
            rows.append(
                [
                    d,
                    x["setting"],
                    f"{x['weight_sync_relay_ms']:.3f}",
                    f"{x['weight_sync_relay_over_lb']:.3f}",
                    f"{x['weight_sync_a2a_over_relay']:.2f}",
                    f"{x['weight_sync_direct_over_relay']:.2f}",
                    f"{x['grad_reduce_relay_ms']:.3f}",
                    f"{x['grad_reduce_relay_over_lb']:.3f}",
                    f"{x['grad_reduce_a2a_over_relay']:.2f}",
                    f"{x['grad_over_weight']:.2f}",
                ]
            )
    return table(
        rows,
        (
            "grads",
            "hop+ovh, chunk",
            "ws relay",
            "rly/LB",
            "a2a/rly",
            "dir/rly",
            "gr relay",
            "rly/LB",
            "a2a/rly",
            "gr/ws",
        ),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ultracomm.sim",
        description="Simulated weight_sync / grad_reduce times: all-to-all (Megatron MoE ECHO), ultracomm "
        "direct and relay, and the lower bound, on a modelled fabric. Nothing here is measured.",
    )
    ap.add_argument("--model", default="qwen3-235b-a22b", help="model preset (ultracomm.scenarios.MODELS)")
    ap.add_argument("--domain", default="nvl72", help="fabric preset: h100x8, h200x8, nvl72, <n>x8-rdma")
    ap.add_argument("--ep", type=int, default=64, help="EP ranks (must fit the fabric and divide the experts)")
    ap.add_argument("--slots", type=int, default=2, help="replica slots per rank")
    ap.add_argument(
        "--imbalance",
        type=_floats,
        default=[1.5, 2.0, 3.0],
        help="target max:mean rank loads of the Zipf loads, comma separated",
    )
    ap.add_argument(
        "--planner",
        default=None,
        help="greedy (workloads.greedy_replicas; the default), quota (UltraEP; the default of "
        "--calibrate), lpt, taot, feplb",
    )
    ap.add_argument(
        "--grad-dtype",
        type=_dtypes,
        default=("bf16", "fp32"),
        help="gradient dtypes, comma separated (fp32, bf16, fp16); every method is charged the same",
    )
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-bytes", type=_size, default=1 << 20)
    ap.add_argument("--max-depth", type=int, default=None, help="relay tree depth limit (default: the builder's)")
    ap.add_argument("--max-chunks", type=int, default=0, help="merge chunks to at most this many (0: exact)")
    ap.add_argument(
        "--profile",
        metavar="FILE",
        help="hardware profile JSON from perf/bench_gpu.py (default: ULTRACOMM_HW_PROFILE, else the newest "
        "perf/gpu/*profile*.json, else the assumed costs of ultracomm.sim.hardware)",
    )
    ap.add_argument("--no-profile", action="store_true", help="use the assumed costs even if a profile exists")
    ap.add_argument("--multicast-sms", type=int, default=None, help="SM budget of weight_sync (0: not modelled)")
    ap.add_argument("--reduce-sms", type=int, default=None, help="SM budget of grad_reduce (0: not modelled)")
    ap.add_argument("--json", metavar="FILE", help="write the rows (and the fabric) as JSON")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--calibrate",
        action="store_true",
        help="UltraEP's EP64 setting (37,748,736 B experts, 4+2 slots) next to its published figures",
    )
    mode.add_argument("--goals", action="store_true", help="the goal sweep over models and EP sizes")
    mode.add_argument(
        "--sensitivity",
        action="store_true",
        help="the case at every (hop latency + per-chunk overhead, chunk size) of the grid",
    )
    a = ap.parse_args(argv)
    kw = dict(tokens=a.tokens, seed=a.seed, max_depth=a.max_depth, max_chunks=a.max_chunks or None)
    try:
        fab = get_fabric(a.domain, profile=None if a.no_profile else default_profile(a.profile))
        budgets = {k: v for k, v in (("multicast_sms", a.multicast_sms), ("reduce_sms", a.reduce_sms)) if v is not None}
        if budgets:
            fab = fab.replace(**budgets)
        if a.calibrate:
            res = calibration.calibrate(
                a.domain, a.planner or "quota", grad_dtype=a.grad_dtype, fabric=fab, chunk_bytes=a.chunk_bytes, **kw
            )
            print("# simulated (no GPU measured anything here); " + res["fabric"].describe())
            print("# " + res["setting"])
            hdr, rows = calibration.calibration_table(res)
            print(table(rows, hdr))
            print("# " + res["verdict"])
            print("# " + calibration.describe_grad(res))
            out = {**res, "fabric": dataclasses.asdict(res["fabric"])}
        elif a.goals:

            def prog(r):
                print(
                    f"{r['model']:>16} EP{r['ep']:<3} {r['domain']:>9} E={r['num_experts']:<4}"
                    f"{'(padded)' if r['padded'] else '        '} slots {r['slots']} " + "  ".join(fmt_row(r)),
                    flush=True,
                )

            print("# simulated goal sweep; columns: model EP fabric experts slots | " + " ".join(HDR))
            res = goals_mod.goals(
                a.imbalance,
                planner=a.planner or "greedy",
                progress=prog,
                grad_dtype=a.grad_dtype,
                chunk_bytes=a.chunk_bytes,
                **kw,
            )
            print(goals_mod.goal_summary(res["cases"]))
            out = res
        elif a.sensitivity:
            fabw = fab.for_world(a.ep)
            print(
                f"# simulated sensitivity: {a.model}, EP {a.ep}, {a.slots} slots/rank, planner "
                f"{a.planner or 'greedy'}; {fabw.describe()}"
            )
            out = {"model": a.model, "domain": a.domain, "ep": a.ep, "slots": a.slots, "cases": []}
            for imb in a.imbalance:
                res = sens.sensitivity_case(
                    a.model,
                    fabw,
                    a.ep,
                    a.slots,
                    imb,
                    planner=a.planner or "greedy",
                    tokens=a.tokens,
                    seed=a.seed,
                    grad_dtype=a.grad_dtype,
                    max_depth=a.max_depth,
                    max_chunks=a.max_chunks or None,
                )
                print(f"## imbalance {imb:g}")
                print(_sensitivity_text(res))
                out["cases"].append({"imbalance": imb, **res})
        else:
            fabw = fab.for_world(a.ep)
            rows = run_case(
                a.model,
                fabw,
                a.ep,
                a.slots,
                a.imbalance,
                planner=a.planner or "greedy",
                grad_dtype=a.grad_dtype,
                chunk_bytes=a.chunk_bytes,
                **kw,
            )
            print(
                f"# simulated: {a.model}, EP {a.ep}, {a.slots} slots/rank, planner {a.planner or 'greedy'}, "
                f"{a.tokens} tokens/rank; times in ms; grads of the dtype in column 'grads' charged to every method"
            )
            print("# " + fabw.describe())
            print(table([fmt_row(r) for r in rows], HDR))
            out = {
                "model": a.model,
                "domain": a.domain,
                "ep": a.ep,
                "slots": a.slots,
                "planner": a.planner or "greedy",
                "tokens_per_rank": a.tokens,
                "fabric": dataclasses.asdict(fabw),
                "rows": rows,
            }
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"simulated": True, **out}, f, indent=1, default=_json_default)
    return 0
