"""Pure-torch references for the two operations, used by the tests of every executor.

Slots are handled as flat ``uint8`` byte images in *slot layout*: member ``m`` of an expert
occupies bytes ``[member_off[m], member_off[m] + member_bytes[m])``; bytes between members
(padding) belong to no member and are never written by an operation.

* :func:`reference_multicast` -- what every replica slot must hold after a multicast: the
  home's member bytes.
* :func:`tasks_from_trees` -- task lists built by hand from explicit trees (no builder).
* :func:`reference_reduce_tree` -- the same order derived from the reduce tree (parents).
* :func:`ordered_sum` -- one segment's reduction in the documented order; :func:`member_segments`
  -- the member byte ranges of a chunk (both from :mod:`ultracomm.transports.segments`, where the
  ``p2p`` and ``copy_engine`` transports take them from).
* :func:`reference_reduce` -- replays a schedule's reduce tasks in their documented order:
  per element, ``acc = float32(self)``, then ``acc += float32(source)`` for the sources left
  to right, then ``self = acc.to(grad dtype)``; a relay's partial is rounded into its slot's
  dtype before its parent reads it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from ..records import MASTER, REF_DTYPE, TASK_DTYPE, TaskKind
from ..transports.segments import member_segments, ordered_sum
from ..errors import InputError


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def slot_image(
    members: Sequence[torch.Tensor], member_off: Sequence[int], slot_bytes: int, fill: int = 0
) -> torch.Tensor:
    """Member tensors placed in slot layout: a ``uint8[slot_bytes]``, padding = ``fill``."""
    out = torch.full((slot_bytes,), fill, dtype=torch.uint8)
    for t, off in zip(members, member_off):
        b = _u8(t)
        out[off : off + b.numel()] = b
    return out


def split_image(image: torch.Tensor, like: Sequence[torch.Tensor], member_off: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of :func:`slot_image`: member tensors shaped and typed like ``like``."""
    out = []
    for t, off in zip(like, member_off):
        nb = t.numel() * t.element_size()
        out.append(image[off : off + nb].clone().view(t.dtype).reshape(t.shape))
    return out


def member_mask(member_off: Sequence[int], member_bytes: Sequence[int], slot_bytes: int) -> torch.Tensor:
    """``bool[slot_bytes]``: True on member bytes, False on padding."""
    mask = torch.zeros(slot_bytes, dtype=torch.bool)
    for off, nb in zip(member_off, member_bytes):
        mask[off : off + nb] = True
    return mask


def reference_multicast(
    slot_src: Sequence[Sequence[int]],
    masters: Mapping[int, Sequence[torch.Tensor]],
    member_off: Sequence[int],
    slot_bytes: int,
) -> list[torch.Tensor]:
    """Expected weight slots after a multicast.

    ``slot_src[r][s]``: the expert held by slot ``s`` of rank ``r`` (-1 empty);
    ``masters[e]``: expert ``e``'s member tensors on its home.  Returns, per rank, a
    ``uint8[slots, slot_bytes]`` of the home's bytes (zeros on padding and empty slots;
    compare with :func:`member_mask`).
    """
    images = {e: slot_image(ms, member_off, slot_bytes) for e, ms in masters.items()}
    out = []
    for row in slot_src:
        t = torch.zeros((len(row), slot_bytes), dtype=torch.uint8)
        for s, e in enumerate(row):
            if int(e) >= 0:
                t[s] = images[int(e)]
        out.append(t)
    return out


def reference_reduce(
    tasks_by_rank: Sequence[np.ndarray],
    refs_by_rank: Sequence[np.ndarray],
    grads_by_rank: Sequence[torch.Tensor],
    master_grads: Mapping[int, Sequence[torch.Tensor]],
    member_off: Sequence[int],
    member_bytes: Sequence[int],
    dtype: torch.dtype,
):
    """Replays reduce tasks (``records.TASK_DTYPE`` / ``REF_DTYPE`` arrays per rank).

    ``grads_by_rank[r]``: rank ``r``'s replica grad slots before the reduce, ``uint8[slots,
    grad_slot_bytes]``; ``master_grads[e]``: expert ``e``'s master grad members on its home
    (dtype ``dtype``).  Inputs are not modified.  Returns ``(grads, masters)``: the slots
    after the reduce (relays hold their partials) and the new master grad members.

    Tasks run as soon as their relay sources are final (a relay source ``(r, s)`` for chunk
    ``c`` is final once the task with ``self == (r, s)`` and chunk ``c`` ran), which is the
    order the schedule's levels encode.
    """
    grads = [g.clone().reshape(g.shape[0], -1) for g in grads_by_rank]
    mbytes = max(o + n for o, n in zip(member_off, member_bytes))
    masters = {int(e): slot_image(ms, member_off, mbytes) for e, ms in master_grads.items()}

    def buf(rank: int, slot: int, expert: int) -> torch.Tensor:
        return masters[expert] if slot == MASTER else grads[rank][slot]

    pending = [(r, t) for r, ts in enumerate(tasks_by_rank) for t in ts]
    relays = {(r, int(t["self_slot"])) for r, t in pending if int(t["self_slot"]) >= 0}
    final: set[tuple[int, int, int]] = set()
    while pending:
        rest = []
        for r, t in pending:
            b, n, c = int(t["ref_begin"]), int(t["ref_count"]), int(t["chunk"])
            srcs = [(int(x["rank"]), int(x["slot"])) for x in refs_by_rank[r][b : b + n]]
            if any(s in relays and (s[0], s[1], c) not in final for s in srcs):
                rest.append((r, t))
                continue
            dst = buf(r, int(t["self_slot"]), int(t["expert"]))
            for _, lo, hi in member_segments(int(t["offset"]), int(t["bytes"]), member_off, member_bytes):
                ordered_sum(dst[lo:hi], [grads[sr][ss][lo:hi] for sr, ss in srcs], dtype)
            if int(t["self_slot"]) >= 0:
                final.add((r, int(t["self_slot"]), c))
        if len(rest) == len(pending):
            raise InputError("reference_reduce: tasks wait on relays that never finish (cyclic schedule)")
        pending = rest
    new_masters = {e: split_image(masters[e], master_grads[e], member_off) for e in masters}
    return grads, new_masters


def tasks_from_trees(world: int, trees, slot_bytes: int, chunk: int, kind: TaskKind):
    """Hand-built per-rank task lists from explicit trees (tests, microbenchmarks).

    ``trees``: list of (expert, home, children) with children: {node: [child nodes]}, a node
    being (rank, slot) and the home's master (home, MASTER).  Multicast: every node with
    children copies each chunk to them (level = depth).  Reduce: every node with children
    reduces them in the listed order (level = height).  Lists sorted by (chunk, level)."""
    per_rank = [[] for _ in range(world)]
    nchunks = -(-slot_bytes // chunk)
    for expert, home, children in trees:
        depth = {(home, MASTER): 0}
        stack = [(home, MASTER)]
        while stack:
            n = stack.pop()
            for c in children.get(n, []):
                depth[c] = depth[n] + 1
                stack.append(c)

        def height(n):
            return 0 if not children.get(n) else 1 + max(height(c) for c in children[n])

        for node, kids in children.items():
            if not kids:
                continue
            level = depth[node] if kind == TaskKind.COPY else height(node)
            for c in range(nchunks):
                off = c * chunk
                per_rank[node[0]].append((c, level, expert, off, min(chunk, slot_bytes - off), node, kids))
    tasks, refs = [], []
    for items in per_rank:
        items.sort(key=lambda x: (x[0], x[1], x[2]))
        t = np.zeros(len(items), dtype=TASK_DTYPE)
        r = []
        for i, (c, level, expert, off, nb, node, kids) in enumerate(items):
            t[i] = (int(kind), 0, level, expert, c, len(r), len(kids), 0, off, nb, node[0], node[1])
            r.extend(kids)
        tasks.append(t)
        refs.append(np.array(r, dtype=REF_DTYPE))
    return tasks, refs


def reference_reduce_tree(sched, grads: dict, master: dict, dtype=np.float32) -> dict:
    """Numpy reference of the reduce op from the schedule's *tree* (not its tasks): the documented
    summation order stated recursively, ``partial(x) = grad(x) + sum over children by (rank, slot)``.

    ``grads[(rank, slot)]`` and ``master[expert]`` are 1-D arrays of the grad dtype (``grad_bytes``
    long in bytes).  Returns ``{expert: reduced}`` for every expert with replicas, computed per
    chunk as the tasks do (fp32 accumulation, rounding to ``dtype`` at every relay and home).
    """
    pr, ps, _ = sched.tree("reduce")
    inp = sched.inputs()
    S = sched.slots_per_rank
    slot_src = np.asarray(inp["slot_src"]).reshape(-1, S) if S else np.zeros((sched.world, 0), np.int32)
    home_of = inp["home_of"]
    kids: dict = {}
    for r in range(sched.world):
        for s in range(S):
            if pr[r, s] >= 0:
                key = (int(pr[r, s]), int(ps[r, s]), int(slot_src[r, s]))
                kids.setdefault(key, []).append((r, s))
    memo: dict = {}

    def value(rank, slot, e):
        if (rank, slot, e) in memo:
            return memo[(rank, slot, e)]
        base = master[e] if slot == MASTER else grads[(rank, slot)]
        acc = base.astype(np.float32)
        for cr, cs in sorted(kids.get((rank, slot, e), [])):
            acc = acc + value(cr, cs, e).astype(np.float32)
        v = acc.astype(dtype)
        memo[(rank, slot, e)] = v
        return v

    out = {}
    for e in range(len(home_of)):
        if (int(home_of[e]), MASTER, e) in kids:
            out[e] = value(int(home_of[e]), MASTER, e)
    return out
