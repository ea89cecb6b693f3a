"""Does a stream wait (cuStreamWaitValue64 GEQ) on a pinned host word pass when the CPU writes it?"""
import ctypes, threading, time, sys
import torch
from ultracomm.cuda.driver import driver

drv = driver()
torch.cuda.init(); torch.zeros(1, device="cuda")
drv.bind(0)

def case(name, stream_kind, writer, flags=0):
    w = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    addr = w.data_ptr()
    if stream_kind == "legacy":
        s = 0
    elif stream_kind == "torch":
        st = torch.cuda.Stream(); s = st.cuda_stream
    else:
        s = drv.stream_create(0)
    drv._check(drv._wait(s, addr, 5, flags), "wait")
    ev = torch.cuda.Event(); ev.record(torch.cuda.ExternalStream(s) if s else torch.cuda.default_stream())
    time.sleep(0.3)
    before = ev.query()
    t = time.monotonic()
    writer(w, addr)
    ok = False
    while time.monotonic() - t < 2.0:
        if ev.query():
            ok = True; break
        time.sleep(1e-3)
    print(f"{name}: stream={stream_kind} flags={flags:#x} passed_before_write={before} passed_after_write={ok} "
          f"in {time.monotonic()-t:.3f}s word={w[0].item()}", flush=True)
    if not ok:  # unblock it so later cases run: a device-side write
        drv.write_value(drv.stream_create(-1), addr, 1 << 40)
        t = time.monotonic()
        while not ev.query() and time.monotonic() - t < 2.0:
            time.sleep(1e-3)
        print(f"   unblocked by a device write: {ev.query()}", flush=True)

def cpu_write(w, addr):
    ctypes.c_uint64.from_address(addr).value = 7

def cpu_write_thread(w, addr):
    th = threading.Thread(target=cpu_write, args=(w, addr)); th.start(); th.join()

def dev_write(w, addr):
    drv.write_value(drv.stream_create(-1), addr, 7)

for sk in ("legacy", "driver"):
    case("cpu ctypes write", sk, cpu_write)
case("cpu write, other thread", "driver", cpu_write_thread)
case("device stream write", "legacy", dev_write)
case("cpu write, FLUSH", "driver", cpu_write, flags=1 << 30)
print("done", flush=True)
