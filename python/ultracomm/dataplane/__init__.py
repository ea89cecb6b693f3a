"""Choosing a Context's data plane: device, transport and window, and the checks that follow.

Rules (``transport`` / ``window`` are the config values, ``device`` the Context argument):

1. Where the window lives: ``device`` when given (``"cpu"``, ``"cuda"``, ``"cuda:N"``, an
   index); else where an explicitly named window lives; else CUDA when an explicitly named
   transport is a GPU one (``tma``); else the CPU.  Contradictions are errors.
2. ``transport="auto"``: ``tma`` for a CUDA window, ``host`` for a CPU one, when every rank
   shares one memory domain; a Context whose ranks span domains passes the choice of
   :mod:`ultracomm.dataplane.domains` (``p2p``, or ``split`` where domains hold several ranks: host
   inside on the CPU, tma inside on CUDA; a CUDA domain over several hosts gets the ``nvshmem``
   window).  A GPU transport on a machine without a GPU or without
   ``ultracomm._cuda`` raises :class:`~ultracomm.cuda.support.NotAvailableError` naming what
   is missing; so does, after that, a named window that cannot work here (``nvshmem`` without
   nvshmem4py, for instance).
3. ``window="auto"``: the best provider for that device among the transport's providers
   (``ultracomm.windows``).
4. ``register_masters``: tensors on the window's device; for a CUDA window every
   (expert, member) address 16-byte aligned (TMA bulk copies; contiguity is the layout's check).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ..comm import Comm
from ..cuda.support import NotAvailableError, resolve_device
from .domains import TransportChoice
from ..env import Config
from ..errors import InputError, RegistrationError
from ..cuda.sm_budget import choices_for_device
from ..transports import GPU_TRANSPORTS, resolve_transport
from ..windows import PROVIDERS, device_type_of, resolve_provider

__all__ = ["device_type", "select", "transport_kwargs", "check_master_devices", "is_stream_ordered"]

log = logging.getLogger("ultracomm")

TMA_ALIGN = 16  # bytes: cp.async.bulk needs 16-byte aligned addresses and sizes


def _type_of(device: Any) -> str:
    t = "cuda" if isinstance(device, int) and not isinstance(device, bool) else torch.device(device).type
    if t not in ("cpu", "cuda"):
        raise InputError(f"ultracomm: device must be a CPU or CUDA device, got {device!r}")
    return t


def device_type(transport: str, window: str, device: Any = None) -> str:
    """``"cpu"`` or ``"cuda"``: where the Context's window lives (rule 1)."""
    if window != "auto" and window not in PROVIDERS:
        resolve_provider(window, None)  # raises: provider not in this build
    win_type = device_type_of(window) if window != "auto" else None
    if win_type == "any":  # private: lives where the device says
        win_type = None
    if device is not None:
        t = _type_of(device)
        if win_type is not None and win_type != t:
            raise InputError(
                f"ultracomm: window {window!r} lives on the {win_type.upper()} but device={device!r}; "
                f"drop one of them or pick a {t.upper()} window"
            )
        if transport in GPU_TRANSPORTS and t == "cpu":
            raise InputError(f"ultracomm: transport {transport!r} runs on a GPU but device={device!r}")
        if transport == "host" and t == "cuda":
            raise InputError(
                f"ultracomm: transport 'host' runs on the CPU but device={device!r}; use transport='tma'"
                " (or 'auto') for a CUDA Context"
            )
        return t
    if win_type is not None:
        return win_type
    return "cuda" if transport in GPU_TRANSPORTS else "cpu"


def select(
    config: Config, comm: Comm, device: Any = None, choice: TransportChoice | None = None
) -> tuple[type, str, torch.device | None]:
    """(transport class, window provider, CUDA device or ``None``) for a Context (rules 1-3).
    ``choice``: what ``transport="auto"`` became from the ranks' domains (logged once here)."""
    dtype = device_type(config.transport, config.window, device)
    transport_cls = resolve_transport(choice.transport if choice is not None else config.transport, dtype)
    window = config.window
    if window == "auto" and choice is not None and choice.window is not None:
        window = choice.window  # the domain needs it (nvshmem: a CUDA domain over several hosts)
    provider = resolve_provider(window, comm, dtype, allowed=transport_cls.window_providers)
    if provider not in transport_cls.window_providers:
        raise InputError(
            f"ultracomm: transport {transport_cls.name!r} cannot use window {provider!r}; "
            f"use one of {transport_cls.window_providers}"
        )
    why = getattr(PROVIDERS[provider], "unavailable_reason", lambda c: None)(comm)
    if window != "auto" and why:
        raise NotAvailableError(f"ultracomm: window {provider!r} is not available: {why}")
    cuda_dev = resolve_device(device) if dtype == "cuda" else None
    if choice is not None:
        log.info("ultracomm: rank %d: %s", comm.rank, choice.describe())
    log.info(
        "ultracomm: rank %d: transport %s (%s), window %s (%s)%s",
        comm.rank,
        transport_cls.name,
        config.transport,
        provider,
        config.window,
        f" on {cuda_dev}" if cuda_dev is not None else "",
    )
    return transport_cls, provider, cuda_dev


def is_stream_ordered(transport: Any) -> bool:
    """True for transports whose ``run`` only enqueues work on a CUDA stream (declared:
    :class:`~ultracomm.transports.base.Transport`)."""
    return bool(transport.stream_ordered)


def transport_kwargs(transport_cls: type, config: Config, cuda_dev: torch.device | None, **base: Any) -> dict[str, Any]:
    """The keyword arguments ``transport_cls`` takes: the common ones of ``base`` (rank, world,
    window, wlayout, layout) and ``timeout_s``, plus what its declared ``options`` name (see
    :mod:`ultracomm.transports.base`): ``base``'s others, the config's executor knobs and
    ``multicast_sms`` / ``reduce_sms`` (resolved: env value or the analytic default of
    :mod:`ultracomm.cuda.sm_budget`, logged at debug level)."""
    options = transport_cls.options
    kw = dict(
        base,
        num_workers=config.num_workers,
        timeout_s=config.timeout_s,
        jitter_us=config.jitter_us,
        split_route=config.split_route,
        tile_bytes=config.tile_bytes,
        reduce_path=config.reduce_path,
    )
    if "multicast_sms" in options or "reduce_sms" in options:
        dev_sms = name = None
        if cuda_dev is not None:
            props = torch.cuda.get_device_properties(cuda_dev)
            dev_sms, name = props.multi_processor_count, props.name
        mc, rd = choices_for_device(
            config.multicast_sms, config.reduce_sms, config.intra_bw, dev_sms, name, config.hw_profile
        )
        log.debug("ultracomm: rank %s: multicast_sms=%d (%s)", base.get("rank"), mc.sms, mc.source)
        log.debug("ultracomm: rank %s: reduce_sms=%d (%s)", base.get("rank"), rd.sms, rd.source)
        kw.update(multicast_sms=mc.sms, reduce_sms=rd.sms)
    common = ("rank", "world", "window", "wlayout", "layout", "timeout_s")
    return {k: v for k, v in kw.items() if k in common or k in options}


def check_master_devices(
    window_device: torch.device,
    transport_name: str,
    names: Sequence[str],
    weights: Sequence,
    grads: Sequence,
    experts_per_rank: int,
) -> None:
    """Rule 4; ``names`` are the layout's member names (for the messages).  A member is a
    stacked ``[experts_per_rank, ...]`` tensor or a list of per-expert tensors."""
    entries = []  # (label, tensor, bytes of one expert's row in it)
    for kind, members in (("weights", weights), ("grads", grads)):
        for n, m in zip(names, members):
            if m is None:  # a member without a gradient
                continue
            if isinstance(m, torch.Tensor):
                entries.append((f"{kind}[{n!r}]", m, m.numel() // max(experts_per_rank, 1) * m.element_size()))
            else:
                entries += [(f"{kind}[{n!r}][{i}]", t, t.numel() * t.element_size()) for i, t in enumerate(m)]
    if window_device.type == "cpu":
        for label, t, _ in entries:
            if t.device.type != "cpu":
                raise RegistrationError(
                    f"ultracomm: {label} is on {t.device}, but this Context's window is on the CPU "
                    f"(transport {transport_name!r}); move the tensors with .cpu(), or create the Context "
                    "with device='cuda' to run the tma transport on the GPU"
                )
        check_disjoint([(label, t) for label, t, _ in entries])
        return
    for label, t, per_expert in entries:
        if t.device != window_device:
            raise RegistrationError(
                f"ultracomm: {label} is on {t.device}, but this Context's window is on {window_device}; "
                f"the {transport_name} transport reads and writes masters on the window's GPU: move them "
                f"with .to('{window_device}')"
            )
        if t.numel() and (t.data_ptr() % TMA_ALIGN or per_expert % TMA_ALIGN):
            raise RegistrationError(
                f"ultracomm: {label}: every expert's row must start 16-byte aligned for TMA bulk copies, "
                f"got base 0x{t.data_ptr():x} and {per_expert} bytes per expert; register a fresh allocation "
                "and pad the member so that its bytes per expert are a multiple of 16"
            )
    check_disjoint([(label, t) for label, t, _ in entries])


def check_disjoint(entries: Sequence[tuple[str, torch.Tensor]]) -> None:
    """No registered grad shares a byte with another registered grad: ``grad_reduce`` adds into
    each, so aliased grads would take two experts' (or members') reductions into one memory.  A
    grad may alias a weight: callers that only reduce (DeepEP's ``lb_reduce_grads``) register one
    tensor as both.  ``entries``: ``(label, tensor)``, contiguous, on one device (meta tensors,
    which have no memory, are skipped)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, (_, t) in enumerate(entries)
        if t.numel() and t.device.type != "meta"
    )
    for k, (_, end, i) in enumerate(spans):
        for other_start, _, j in spans[k + 1 :]:
            if other_start >= end:
                break
            first, second = entries[min(i, j)][0], entries[max(i, j)][0]
            if first.startswith("grads") and second.startswith("grads"):
                raise RegistrationError(
                    f"ultracomm: {second} overlaps {first} in memory; grad_reduce adds into the grads, so each "
                    "registered grad needs memory of its own: pass separate tensors (e.g. .clone() the one "
                    "that is a view of the other)"
                )


def slot_views(
    window: Any,
    layout: Any,
    slots_per_rank: int,
    region_off: int,
    stride: int,
    member_offs: Sequence[int],
    dtypes: Sequence[torch.dtype | None],
) -> tuple[torch.Tensor | None, ...]:
    """``[slots_per_rank, *member.shape]`` views of member ``m`` in every slot of a window region
    (None where its dtype is None: a member without bytes there)."""
    views: list[torch.Tensor | None] = []
    for member, off, dt in zip(layout.members, member_offs, dtypes):
        if dt is None:
            views.append(None)
            continue
        esz = torch.empty((), dtype=dt).element_size()
        inner = [1] * len(member.shape)
        for i in range(len(member.shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * member.shape[i + 1]
        # window sizes and offsets are 256/16-byte aligned; each view gets its own tensor over the window
        # (own version counter): autograd may save a replica weight while grads are written next to it
        # (the window may start inside its storage -- a page-aligned pool -- and as_strided's offset
        # counts from the storage's start)
        local = window.local
        base = local.storage_offset()
        assert base % esz == 0, f"window starts {base} B into its storage, not a multiple of {esz}"
        flat = torch.empty(0, dtype=dt, device=local.device).set_(
            local.untyped_storage(), base // esz, (local.numel() // esz,), (1,)
        )
        views.append(
            torch.as_strided(
                flat, (slots_per_rank, *member.shape), (stride // esz, *inner), (base + region_off + off) // esz
            )
        )
    return tuple(views)


def check_like(given: Any, views: Sequence[torch.Tensor | None], what: str) -> None:
    """``given`` is one tensor per entry of ``views``, of its shape, dtype and device (None where the
    view is None: a member without bytes there); else InputError saying ``what`` each must be."""
    if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
        raise InputError(
            f"ultracomm: grads must be a list of one {what} tensor per member (None for a member without "
            f"a gradient); got {type(given).__name__}"
        )
    if len(given) != len(views) or any(
        (g is None) != (v is None)
        or (
            v is not None
            and (not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(v.shape) or g.dtype != v.dtype)
        )
        for g, v in zip(given, views)
    ):
        got = [
            None if g is None else (tuple(g.shape), g.dtype) if isinstance(g, torch.Tensor) else type(g).__name__
            for g in given
        ]
        raise InputError(
            f"ultracomm: grads must be one {what} tensor per member (None for a member without a gradient); got {got}"
        )
    for m, (g, v) in enumerate(zip(given, views)):
        if v is not None and g.device != v.device:
            raise InputError(
                f"ultracomm: grads[{m}] is on {g.device}, but the replica grad slots it is copied into are on "
                f"{v.device}; move it with .to('{v.device}')"
            )


def copy_into(views: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor | None]) -> None:
    """``views[m].copy_(sources[m])`` for every member with bytes there (an operation's ``before``)."""
    for dst, src in zip(views, sources):
        if dst is not None:
            dst.copy_(src)


def zero_slots(views: Sequence[torch.Tensor | None], slots: Sequence[int]) -> None:
    """Zero ``slots`` of every member's views (an operation's ``after``)."""
    for v in views:
        for s in slots if v is not None else ():
            v[s].zero_()
