"""Run under torchrun (gloo, world 4): torch DDP over the expert-data-parallel group, as a user
of EP 2 x EDP 2 runs it (issue 32, item 1).  EP groups {0,1} {2,3} each own a ReplicaManager;
EDP groups {0,2} {1,3} hold the same experts and DDP averages their gradients.  The same model
is trained 3 SGD steps without ultracomm (every token on its home expert) and with it, under
DDP with and without ``find_unused_parameters``, each step two micro-batches (the first under
``ddp.no_sync()``: its replica gradients wait in ``.grad`` for the second's all-reduce); every step's loss, every expert parameter's
DDP-averaged ``.grad`` and the parameters after the last step must agree within 1e-5 of each
tensor's largest value.  Prints one line per rank and mode; exit 1 on a failed check.

    torchrun --standalone --nproc-per-node 4 tests/mp_ddp_edp.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_harness as mh  # noqa: E402
import stacks_harness as sh  # noqa: E402

# HOT: a mild skew, so that every expert gets tokens and DDP without find_unused_parameters
# accepts the model without ultracomm too (with the harness's default 3.0 it raises there)
EP, EPR, K, LAYERS, STEPS, TOKENS, HOT = 2, 2, 1, 2, 3, 24, 1.5


class Experts(torch.nn.Module):
    """The MoE layers' experts of one EP rank (stacked ``[epr, ...]`` parameters); ``forward``
    is one step's loss on this rank, with or without a ReplicaManager."""

    def __init__(self, ep_rank: int):
        super().__init__()
        self.ep_rank = ep_rank
        self.layers = torch.nn.ModuleList()
        for ps in mh.make_params(ep_rank, EPR, LAYERS, torch.float32, "stacked", False, False):
            m = torch.nn.Module()
            m.fc1, m.fc2 = ps
            self.layers.append(m)
        self.mgr = None
        self.replicated = 0  # replica slots filled over the run (on this EP group)

    def forward(self, it: int, edp: int) -> torch.Tensor:
        from ultracomm.moe import linear

        loss = torch.zeros(())
        mb = 10 * it + edp  # each EDP replica its own data
        for layer, m in enumerate(self.layers):
            _, rmap, probs, _ = mh.batch(self.ep_rank, layer, mb, EP * EPR, TOKENS, hot=HOT)
            step = self.mgr.step(layer, rmap, probs) if self.mgr else sh.NoReplica(EP, EPR, K)
            reps = step.replica_weights() if self.mgr else None
            if self.mgr:
                self.replicated += int((step.result.plan.slot_src >= 0).sum())
            part = mh.rank_loss(
                step,
                self.ep_rank,
                EP,
                layer,
                mb,
                [m.fc1, m.fc2],
                reps,
                linear,
                tokens=TOKENS,
                hot=HOT,
                skip_replicas=self.mgr is None,
            )
            loss = loss + (step.guard(part) if self.mgr else part)
        return loss


def train(ultracomm: bool, find_unused: bool, ep_group, edp_group, ep_rank: int, edp: int) -> dict:
    from ultracomm.moe import ReplicaManager

    model = Experts(ep_rank)
    if ultracomm:
        model.mgr = ReplicaManager(ep_group, mh.layout(), EPR, K, LAYERS, planner="quota", timeout_s=60)
        for layer, m in enumerate(model.layers):
            model.mgr.register_layer(layer, [m.fc1, m.fc2])
    ddp = DDP(model, process_group=edp_group, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    out = {"loss": [], "grads": [], "params": None}
    for it in range(STEPS):
        with ddp.no_sync():  # gradient accumulation: a first micro-batch without DDP's all-reduce
            first = ddp(100 + it, edp)
            first.backward()
        loss = ddp(it, edp)
        loss.backward()
        # each rank computes other tokens with replication: the EP group's sum
        total = loss.detach() + first.detach()
        dist.all_reduce(total, group=ep_group)
        out["loss"].append(total.item())
        out["grads"].append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["replicated"] = model.replicated
    if model.mgr:
        model.mgr.close()
    return out


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "run with --nproc-per-node 4"
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_rank, edp = rank % EP, rank // EP
    ok = True
    for find_unused in (True, False):
        args = (find_unused, ep_groups[edp], edp_groups[ep_rank], ep_rank, edp)
        base = train(False, *args)
        got = train(True, *args)
        try:
            sh.compare([base], [got])
            verdict = "yes"
        except AssertionError as e:
            verdict, ok = f"NO ({e})", False
        print(
            f"rank {rank} find_unused_parameters={find_unused}: replicas {got['replicated']}, matches the run "
            f"without ultracomm: {verdict}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
