"""What vLLM's EPLB code calls on its communicator, release by release.

Read from the released wheels (``pip download vllm==X --no-deps``), files
``vllm/distributed/eplb/eplb_communicator.py``, ``rebalance_execute.py``, ``eplb_state.py``,
``async_worker.py`` and (0.32+) ``migration_scheduler.py``, for 0.20.0, 0.20.2, 0.21.0, 0.22.0,
0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.25.1, 0.26.0, 0.27.0, 0.27.1, 0.28.0 ... 0.34.0:

* every release: ``set_stream(stream)`` (async worker), ``needs_profile_buffer_reservation``
  (profile run), per layer ``add_send(tensors, dst_rank, expert_id=)`` /
  ``add_recv(tensors, src_rank, expert_id=)`` for every remote move, then ``execute``.
* 0.20: ``add_send(tensor, dst_rank)`` once per weight tensor, no ``expert_id``: moves of one
  expert cannot be told apart, so there is nothing to multicast.  Not supported.
* 0.21 - 0.22.1: ``execute(old_indices=old)``; no ``set_transfer_context``; the factory is
  ``create_eplb_communicator(group_coordinator, backend, expert_weights)`` with *one layer's*
  tensors (``model.expert_weights[0]``).
* 0.23 - 0.31: ``set_transfer_context(old_indices, layer_idx)`` before the layer's
  ``add_send``/``add_recv``, ``execute()`` without arguments; the factory takes *all layers'*
  tensors and the receive buffer: ``(group_coordinator, backend, expert_weights,
  expert_buffer)``.
* 0.32 - 0.33: as 0.23, and the async worker's ``transfer_layer`` may split a layer into
  rank-pair-disjoint batches, each its own ``set_transfer_context`` ... ``execute()`` round.
* 0.34: ``move_to_buffer`` reads ``needs_recv_rows`` and passes ``recv_rows`` (``None`` unless
  asked for) as ``set_transfer_context``'s third argument; ``eplb_state`` uses
  ``communicator.owned_expert_buffer or expert_buffer`` as the receive buffer; the factory's
  ``expert_buffer`` may be ``None``.

Newer releases are refused rather than guessed at: each release so far changed something here.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConfigError

__all__ = ["Protocol", "FIRST", "LAST", "DEFAULT_VERSION", "SUPPORTED", "installed_vllm_version", "protocol_for"]

FIRST, LAST = (0, 21), (0, 34)
SUPPORTED = "0.21 to 0.34"
DEFAULT_VERSION = "0.34.0"  # what a communicator speaks when vLLM is not installed here


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The communicator calls of one vLLM release (see the module docstring)."""

    version: str  # as given, e.g. "0.34.0"
    release: tuple[int, int]  # (major, minor)
    execute_old_indices: bool  # 0.21-0.22: execute(old_indices=...)
    transfer_context: bool  # 0.23+: set_transfer_context(old_indices, layer_idx, ...)
    recv_rows: bool  # 0.34: set_transfer_context(..., recv_rows); needs_recv_rows, owned_expert_buffer
    factory_all_layers: bool  # 0.23+: the factory takes every layer's tensors and expert_buffer
    migration_batches: bool  # 0.32+: a layer may be several set_transfer_context/execute rounds


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its package metadata (vLLM itself is not imported:
    that pulls in CUDA kernels), or ``None`` when vLLM is not installed."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _release(version: object) -> tuple[int, int]:
    if not isinstance(version, str):
        raise ConfigError(f"ultracomm: vllm_version must be a version string such as '0.34.0', got {version!r}")
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:[.+\-a-z0-9]*)\s*$", version, re.IGNORECASE)
    if m is None:
        raise ConfigError(f"ultracomm: vllm_version {version!r} is not a version such as '0.34.0'")
    return int(m.group(1)), int(m.group(2))


def protocol_for(vllm_version: str | None = None) -> Protocol:
    """The protocol of ``vllm_version`` (``None``: the installed vLLM's, else 0.34).

    Raises :class:`~ultracomm.errors.ConfigError` for a release outside 0.21 - 0.34.
    """
    if vllm_version is None:
        vllm_version = installed_vllm_version() or DEFAULT_VERSION
    release = _release(vllm_version)
    if release < FIRST:
        why = (
            " (vLLM 0.20 calls add_send(tensor, dst_rank) once per weight tensor without expert_id, so "
            "moves of one expert cannot be grouped into a multicast)"
            if release == (0, 20)
            else ""
        )
        raise ConfigError(
            f"ultracomm: vLLM {vllm_version} is not supported{why}; the vLLM EPLB communicator "
            f"matches vLLM {SUPPORTED}: upgrade vLLM, or keep vLLM's own communicator"
        )
    if release > LAST:
        raise ConfigError(
            f"ultracomm: vLLM {vllm_version} is newer than the releases the vLLM EPLB communicator "
            f"was checked against ({SUPPORTED}); its communicator calls may differ: use vLLM "
            f"{LAST[0]}.{LAST[1]}, or keep vLLM's own communicator until ultracomm is checked "
            f"against {vllm_version}"
        )
    return Protocol(
        version=vllm_version,
        release=release,
        execute_old_indices=release <= (0, 22),
        transfer_context=release >= (0, 23),
        recv_rows=release >= (0, 34),
        factory_all_layers=release >= (0, 23),
        migration_batches=release >= (0, 32),
    )
