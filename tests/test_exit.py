"""Process teardown: ultracomm keeps no process group alive past destroy_process_group, and no
thread of its own is inside a C++ call when Python finalizes.

Either used to abort a rank at exit after its work was done ("terminate called without an
active exception", SIGABRT): a gloo group kept alive by a Context (through a Step's autograd
cycle) still had worker threads that re-took the GIL during finalization, and a store thread
whose c10d call returned during finalization did the same (CPython ends such a thread by
unwinding it through C++ frames: std::terminate).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )


@pytest.mark.slow
def test_contexts_and_managers_do_not_keep_a_destroyed_group_alive(tmp_path):
    p = run_script(
        """
        import gc, weakref
        import numpy as np, torch, torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        import moe_harness as mh
        from ultracomm import Context, ExpertLayout, Member, ReplicaPlan
        from ultracomm.moe import ReplicaManager, linear

        dist.init_process_group("gloo", init_method="file://" + __import__("os").path.abspath("store"), rank=0,
                                world_size=1)
        layout = ExpertLayout((Member("w", (8, 8), torch.float32),))
        plan = ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1)
        kept = []
        for transport, window in (("host", "host_shm"), ("p2p", None)):  # p2p's messenger holds the group too
            ctx = Context(None, layout, 1, 1, num_layers=1, transport=transport, window=window, timeout_s=30)
            ctx.register_masters(0, [torch.zeros(1, 8, 8)], [torch.zeros(1, 8, 8)])
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            ctx.grad_reduce(vid)
            kept.append(ctx)
        kept[0].close()  # one closed, one open: neither may hold the group
        # a manager through forward and backward, then closed and dropped: its Steps sat in an
        # autograd cycle that gc cannot collect, which kept the manager, Context and group alive
        mgr = ReplicaManager(None, mh.layout(), 2, 1, 1, timeout_s=30)
        ps = [torch.nn.Parameter(torch.stack([mh.master_weights(j)[m] for j in range(2)])) for m in range(2)]
        mgr.register_layer(0, ps)
        x, rmap, probs, _ = mh.batch(0, 0, 0, 2)
        step = mgr.step(0, rmap, probs)
        loss = mh.rank_loss(step, 0, 1, 0, 0, ps, step.replica_weights(), linear)
        step.guard(loss).backward()
        mgr.close()
        dropped = [weakref.ref(o) for o in (step, mgr, mgr.ctx)]
        del step, mgr, loss
        group = weakref.ref(c10d._get_default_group())
        dist.destroy_process_group()
        gc.collect()
        print("group alive:", group() is not None)
        print("step, manager, context alive:", [r() is not None for r in dropped])
    """,
        tmp_path,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "group alive: False" in p.stdout, p.stdout
    assert "step, manager, context alive: [False, False, False]" in p.stdout, p.stdout


@pytest.mark.slow
def test_a_store_call_running_at_exit_ends_before_python_finalizes(tmp_path):
    # A daemon thread is inside a collective whose peer never arrives when the main thread
    # returns; the store wait (bounded by 4 s) must end before Python finalizes.  An object freed
    # during finalization keeps the interpreter there until the store thread is gone (at once
    # when ultracomm joined it at exit): a store thread still inside the c10d call would re-take
    # the GIL when the wait ends and abort the process.
    p = run_script(
        """
        import linecache, os, sys, threading, time
        import torch.distributed as dist
        from ultracomm import UltracommTimeout
        from ultracomm.comm import as_comm

        # a TCPStore, as torchrun's: its client calls re-take the GIL when they return (port 0: the
        # store's server takes a free one itself; a port picked here and bound later could be taken)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        comm = as_comm(None, timeout_s=4.0)
        comm.world = 2  # a second rank that never arrives: the barrier waits on the store for its 4 s

        def barrier():
            try:
                comm.barrier()
            except UltracommTimeout:
                pass

        threading.Thread(target=barrier, daemon=True).start()
        store_thread = next(t for t in threading.enumerate() if t.name == "ultracomm-store")

        def store_thread_in_wait() -> bool:  # its innermost Python frame calls the c10d wait
            frame = sys._current_frames().get(store_thread.ident)
            return frame is not None and "st.wait(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)

        while not store_thread_in_wait():
            time.sleep(0.001)

        class HoldsFinalization:
            # runs once Python finalizes, when module globals may be gone: everything bound here
            def __del__(self, os=os, time=time, task=f"/proc/self/task/{store_thread.native_id}"):
                deadline = time.monotonic() + 30
                while os.path.exists(task) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.write(1, b"finalization held until the store thread was gone\\n")  # sys.stdout may be gone

        import builtins
        builtins._ = HoldsFinalization()  # builtins._ is the first thing finalization frees
        print("main returns", flush=True)
    """,
        tmp_path,
    )
    assert "terminate called" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout == "main returns\nfinalization held until the store thread was gone\n", p.stdout
