"""The CPU fault matrix (issue 35): SIGKILL / SIGSTOP of one or two ranks of a small MoE training
run (tests/mp/fault_matrix_worker.py) at every point of a step -- Context setup, the load
exchange, the step's planner, weight_sync, between forward and backward, grad_reduce -- at world
4 and 8, on the ``host``, ``p2p`` and ``split`` transports.  Per case, every survivor must raise
``UltracommTimeout`` (or ``PlanMismatchError`` where a plan is the cause), none may hang, no
/dev/shm segment may be left, and its message must name exactly the faulted rank(s) as stopped
(a message that lists ranks of unknown state without calling them stopped names no live rank).

    python perf/fault_matrix.py [--small] [--world 4,8] [--transports host,p2p,split] [--json OUT]

Prints a table per transport and fault (counts: survivors, UltracommTimeout, right rank named,
wrong rank named, only unknown listed, hung, leaked).  ``--small``: one case per transport x
fault kind (what tests/test_fault_matrix.py runs in CI).

The launcher hosts the group's TCPStore (as torchrun's agent does), so killing any rank leaves
it up; workers fork from a forkserver with torch and ultracomm imported.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(TESTS, "mp"))

import fault_matrix_worker as fw  # noqa: E402

TIMEOUT_S = 2.0
HANG_S = 60.0  # a survivor that has not raised by then is hung
_CTX = None


def _mp():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "torch.distributed", "ultracomm.context", "ultracomm.moe", "moe_harness", "fault_matrix_worker"]
        )
    return _CTX


# ------------------------------------------------------------------ which ranks a message calls stopped
_EVIDENCE = re.compile(r"stopped(?: by evidence)?: ranks? \[([\d, ]*)\]")
_UNKNOWN = re.compile(r"state unknown: ranks? \[([\d, ]*)\]")
_LEGACY = (
    re.compile(r"rank (\d+) has not started this operation \(its ready flag is at epoch \d+\): it is likely"),
    re.compile(r"rank (\d+) stopped first"),
    re.compile(r"rank (\d+) is likely stalled or dead"),
)
_LEGACY_LIST = re.compile(r"ranks \[([\d, ]*)\] (?:did not arrive|did not post their loads)")


def _ranks(s: str) -> set[int]:
    return {int(x) for x in s.replace(" ", "").split(",") if x}


def named_stopped(text: str) -> set[int]:
    """The ranks an error message calls stopped (stalled or dead): the evidence sentence's list
    where there is one, else what the older wordings name."""
    m = _EVIDENCE.search(text)
    if m:
        return _ranks(m.group(1))
    out: set[int] = set()
    for p in _LEGACY:
        out |= {int(x) for x in p.findall(text)}
    for m in _LEGACY_LIST.finditer(text):
        out |= _ranks(m.group(1))
    return out


def unknown_listed(text: str) -> set[int]:
    m = _UNKNOWN.search(text)
    return _ranks(m.group(1)) if m else set()


# ------------------------------------------------------------------ one case
def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ultracomm-")} if os.path.isdir("/dev/shm") else set()


def run_case(transport: str, phase: str, kind: str, victims: tuple, world: int, timeout_s: float = TIMEOUT_S) -> dict:
    import torch.distributed as dist

    before = _shm()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ctx = _mp()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=fw.main, args=(r, world, store.port, transport, phase, kind, victims, out_dir, timeout_s)
            )
            for r in range(world)
        ]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        deadline = t0 + HANG_S
        survivors = [r for r in range(world) if r not in victims]
        for r in survivors:
            procs[r].join(max(0.1, deadline - time.monotonic()))
        hung = [r for r in survivors if procs[r].is_alive()]
        for r in victims:  # stopped victims are resumed once the survivors are done, then must end too
            if procs[r].is_alive() and procs[r].pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGCONT)
        for r in victims:
            procs[r].join(max(0.1, min(20.0, deadline + 20 - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = {}
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[r] = json.load(f)
    del store
    pids = {str(p.pid) for p in procs}
    time.sleep(0.05)
    leaked = sorted(n for n in _shm() - before if n.split("-")[1] in pids)
    for n in leaked:  # do not let one case's leak count again in the next
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", n))
    return {
        "transport": transport,
        "phase": phase,
        "kind": kind,
        "victims": list(victims),
        "world": world,
        "hung": hung,
        "leaked": leaked,
        "results": {str(r): v for r, v in results.items()},
        "wall_s": time.monotonic() - t0,
    }


def classify(case: dict) -> list[dict]:
    """One row per survivor: raised, its type, what its message names."""
    victims = set(case["victims"])
    rows = []
    for r in range(case["world"]):
        if r in victims:
            continue
        res = case["results"].get(str(r))
        row = {"rank": r, "hung": r in case["hung"], "reported": res is not None}
        if res is not None and res.get("error"):
            text, mro = res["error"], res.get("mro", [])
            named = named_stopped(text)
            row.update(
                raised=True,
                timeout="UltracommTimeout" in mro,
                mismatch="PlanMismatchError" in mro,
                type=res["type"],
                named=sorted(named),
                right=named == victims,
                wrong=bool(named - victims),
                unknown=sorted(unknown_listed(text)),
                text=text,
            )
        else:
            row.update(raised=False, timeout=False, mismatch=False, named=[], right=False, wrong=False, unknown=[])
        rows.append(row)
    return rows


# ------------------------------------------------------------------ the matrix
def cases(worlds=(4, 8), transports=fw.TRANSPORTS, small: bool = False) -> list[tuple]:
    out = []
    if small:  # one per transport x fault kind: a kill in weight_sync, a stop between forward and backward
        for t in transports:
            out.append((t, "weight_sync", "kill", (3,), 4))
            out.append((t, "between", "stop", (3,), 4))
        return out
    for world in worlds:
        for t in transports:
            for phase in fw.PHASES:
                for kind in ("kill", "stop"):
                    out.append((t, phase, kind, (world - 1,), world))
                    if world == 4 or phase in ("weight_sync", "between"):
                        out.append((t, phase, kind, (1, world - 1), world))
    return out


COLUMNS = ("cases", "survivors", "UltracommTimeout", "PlanMismatch", "right", "wrong", "unknown only", "hung", "leaked")


def tally(all_cases: list[dict]) -> dict:
    table: dict = collections.OrderedDict()
    for case in all_cases:
        rows = classify(case)
        for key in ((case["transport"], f"{case['kind']} x{len(case['victims'])}"), ("all", "")):
            t = table.setdefault(key, dict.fromkeys(COLUMNS, 0))
            t["cases"] += 1
            t["survivors"] += len(rows)
            t["UltracommTimeout"] += sum(r["timeout"] for r in rows)
            t["PlanMismatch"] += sum(r["mismatch"] and not r["timeout"] for r in rows)
            t["right"] += sum(r["right"] for r in rows)
            t["wrong"] += sum(r["wrong"] for r in rows)
            t["unknown only"] += sum(r.get("raised", False) and not r["right"] and not r["wrong"] for r in rows)
            t["hung"] += len(case["hung"])
            t["leaked"] += len(case["leaked"])
    return table


def format_table(table: dict) -> str:
    head = "| transport | fault | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for (t, f), v in sorted(table.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        lines.append(f"| {t} | {f} | " + " | ".join(str(v[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--world", default="4,8")
    ap.add_argument("--transports", default=",".join(fw.TRANSPORTS))
    ap.add_argument("--phases", default=",".join(fw.PHASES))
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S)
    ap.add_argument("--json", default=None, help="write every case and survivor row here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every survivor's message")
    a = ap.parse_args(argv)
    todo = [
        c
        for c in cases(tuple(int(w) for w in a.world.split(",")), tuple(a.transports.split(",")), a.small)
        if c[1] in a.phases.split(",")
    ]
    done = []
    t0 = time.monotonic()
    for i, (t, phase, kind, victims, world) in enumerate(todo):
        case = run_case(t, phase, kind, victims, world, a.timeout)
        rows = classify(case)
        case["rows"] = rows
        done.append(case)
        bad = [r for r in rows if not (r["right"] and (r["timeout"] or r["mismatch"]))]
        print(
            f"[{i + 1}/{len(todo)}] {t} {phase} {kind} victims {list(victims)} world {world}: "
            f"{len(rows) - len(bad)}/{len(rows)} ok, hung {case['hung']}, leaked {len(case['leaked'])} "
            f"({case['wall_s']:.1f} s)",
            flush=True,
        )
        for r in rows if a.verbose else bad:
            print(f"    rank {r['rank']}: {r.get('type')} named {r['named']}: {r.get('text', '')[:600]}", flush=True)
    table = tally(done)
    print(f"\n{len(done)} cases in {time.monotonic() - t0:.0f} s, timeout {a.timeout:g} s\n")
    print(format_table(table))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"timeout_s": a.timeout, "cases": done}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
