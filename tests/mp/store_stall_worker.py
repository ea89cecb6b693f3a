"""Worker of tests/test_store_stall.py: rank 0 of a two-rank exchange whose rank 1 never comes,
over the launcher's TCPStore.  The store thread stops the whole process (SIGSTOP) right after
the store answered the exchange's wait (keys missing, at timeout_s) and well before the
caller's own bound (timeout_s + _QUICK_S); the launcher resumes it after that bound has passed.
Prints the error the exchange raised."""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch.distributed as dist

from ultracomm import comm as C


class _TwoRankComm(C.Comm):
    rank, world, kind = 0, 2, "torch"

    def __init__(self, board: C._StoreBoard, timeout_s: float):
        self.board, self.timeout_s, self.seq = board, timeout_s, 0

    def _board(self) -> C._Board:
        return self.board

    def _next_sequence(self) -> int:
        self.seq += 1
        return self.seq - 1


def _wait_then_stop(self, keys, timeout_s):  # _StoreBoard.wait, stopping once the store answered
    def call(st):
        try:
            return st.wait(list(keys), datetime.timedelta(seconds=timeout_s))
        finally:
            os.kill(os.getpid(), signal.SIGSTOP)

    try:
        self._call(call, timeout_s)
        return True
    except dist.DistStoreError:
        return False


def main() -> None:
    port, timeout_s = int(sys.argv[1]), float(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    C._StoreBoard.wait = _wait_then_stop
    comm = _TwoRankComm(C._StoreBoard(store), timeout_s)
    try:
        comm.all_gather_object(1, op="test", what="stalled exchange")
        print("no error", flush=True)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        print(f"{type(e).__name__}: {e}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
