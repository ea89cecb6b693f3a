"""TAOT phase 1: the rank-level balanced entropic optimal transport from hot ranks' excess to
cold ranks' spare (Sinkhorn-Knopp), the hint phase 2 scores with."""

from __future__ import annotations

import numpy as np


def sinkhorn(
    excess: np.ndarray,
    spare: np.ndarray,
    cost: np.ndarray,
    eps: float,
    iters: int = 100,
    tol: float = 1e-6,
    eps0: float = 1e-9,
    kernel: np.ndarray | None = None,
) -> np.ndarray:
    """Phase 1: balanced entropic OT ``T = diag(u) M diag(v)``, ``M = exp(-cost/eps)``.

    Args:
        excess: ``[R]`` supply (0 on non-hot ranks).
        spare: ``[R]`` demand (0 on non-cold ranks).
        cost: ``[R, R]`` transport cost.
        eps: entropic regularisation.
        iters: maximum Sinkhorn-Knopp iterations (``u = s~ / M v``, ``v = d / M^T u``).
        tol: stop early once every row sum is within ``tol * sum(s~)`` of ``s~``.
        kernel: optional precomputed ``exp(-cost / eps)`` ``[R, R]`` (``cost`` is then
            not read); the planner caches it per domain.

    The supply is scaled by ``gamma = min(1, sum(d) / sum(s))`` (feasibility guard),
    and after the iterations each column is capped at its demand.  Refinement: the
    demand is likewise scaled by ``min(1, sum(s) / sum(d))`` so the problem stays
    balanced when the spare capacity exceeds the excess (it does under the planner's
    balance tolerance; without it the row marginals never converge and every call runs
    all ``iters`` iterations).  Returns the float64 ``[R, R]`` flow.
    """
    s = np.asarray(excess, np.float64)
    d = np.asarray(spare, np.float64)
    R = s.size
    T = np.zeros((R, R))
    hi = (s > 0).nonzero()[0]
    ci = (d > 0).nonzero()[0]
    if hi.size == 0 or ci.size == 0:
        return T
    s_sum, d_sum = s.sum(), d.sum()
    gamma = min(1.0, d_sum / max(s_sum, eps0))
    st = gamma * s[hi]
    dc = d[ci] * min(1.0, s_sum / max(d_sum, eps0))
    if kernel is None:
        M = np.exp(-np.asarray(cost, np.float64)[np.ix_(hi, ci)] / eps)
    else:  # elementwise the same values as above
        M = kernel.take(hi, 0).take(ci, 1)  # = kernel[np.ix_(hi, ci)], faster
    v = np.ones(ci.size)
    thr = tol * st.sum()
    Mv = M @ v
    for _ in range(max(int(iters), 1)):
        u = st / np.maximum(Mv, eps0)
        v = dc / np.maximum(M.T @ u, eps0)
        Mv = M @ v  # row sums of this iterate, reused by the next u update
        if np.abs(u * Mv - st).max() <= thr:
            break
    sub = u[:, None] * M * v[None, :]
    sub *= np.minimum(1.0, dc / (sub.sum(0) + eps0))[None, :]
    T[hi[:, None], ci] = sub
    return T
