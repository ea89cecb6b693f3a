"""Run a failure worker with every thread's stack dumped every 5 s and watchdog states every 1 s."""
import faulthandler, gc, os, runpy, sys, threading, time, ctypes

variant = os.environ.get("DIAG_STREAM", "default")
faulthandler.dump_traceback_later(6, repeat=True, file=sys.stderr)
import torch
if variant == "side":
    s = torch.cuda.Stream()
    torch.cuda.set_stream(s)
    print("diag: caller stream is a torch side stream", s.cuda_stream, file=sys.stderr, flush=True)
else:
    print("diag: caller stream", torch.cuda.current_stream().cuda_stream, file=sys.stderr, flush=True)

def word(a):
    try:
        return ctypes.c_uint64.from_address(a).value
    except Exception as e:
        return repr(e)

def monitor():
    t0 = time.monotonic()
    while True:
        time.sleep(1.0)
        for o in gc.get_objects():
            n = type(o).__name__
            if n.endswith("Watchdog") and hasattr(o, "__dict__"):
                d = o.__dict__
                pend = d.get("_pending")
                info = {k: (repr(v)[:120]) for k, v in d.items() if k in ("failure", "_handed", "_stop", "timeout_s", "check_s")}
                ps = []
                if isinstance(pend, list):
                    for p in pend:
                        try:
                            ps.append(dict(epoch=p.epoch, t0=p.t0, started=word(p.started), joins=[word(j) for j in p.joins]))
                        except Exception as e:
                            ps.append(repr(e)[:100])
                th = d.get("_thread")
                print(f"diag {time.monotonic()-t0:.1f}s {n} rank={d.get('rank')} {info} pending={ps} "
                      f"thread_alive={th.is_alive() if th else None}", file=sys.stderr, flush=True)

threading.Thread(target=monitor, daemon=True).start()
worker = sys.argv[1]
sys.argv = [worker] + sys.argv[2:]
sys.path.insert(0, os.path.dirname(worker))
runpy.run_path(worker, run_name="__main__")
