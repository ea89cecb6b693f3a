"""Which host this process runs on, as ultracomm keys it: ``hostname/boot id``.

Ranks with the same key share host memory (the memory domains of :mod:`ultracomm.dataplane.domains`)
and see each other's processes (:mod:`ultracomm.blame`).  The boot id tells apart hosts that share a
name; the name tells apart VMs cloned from one snapshot, which keep its boot id.
"""

from __future__ import annotations

import socket

__all__ = ["host_key", "UNKNOWN_BOOT"]

UNKNOWN_BOOT = "?"  # the boot id where /proc does not give one


def host_key() -> str:
    """This process's host: ``hostname/boot id`` (``hostname/?`` without a readable boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = UNKNOWN_BOOT
    return f"{socket.gethostname()}/{boot}"
