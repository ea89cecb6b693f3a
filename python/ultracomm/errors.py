"""Exception types raised by the ultracomm Python layer.

Every error derives from :class:`UltracommError` (a ``RuntimeError``), so
``except UltracommError`` catches all of them.  Errors about bad user input also
derive from ``ValueError`` (a wrong type: ``TypeError``) so that generic input-validation
handlers keep working.  No module of the package raises a builtin exception for a cause it
detected (tests/test_error_classes.py reads every ``raise``).

A stalled or dead peer raises :class:`UltracommTimeout` (also a ``TimeoutError``),
whether the wait was in the C++ executor (``ultracomm._core.TimeoutError`` is a
subclass) or in a control-plane collective (setup, plan agreement, window exchange).
"""

from __future__ import annotations

__all__ = [
    "UltracommError",
    "InputError",
    "InputTypeError",
    "PlanError",
    "PlanMismatchError",
    "LayoutError",
    "ConfigError",
    "RegistrationError",
    "UltracommTimeout",
    "PeerError",
    "ClosedError",
]


class UltracommError(RuntimeError):
    """Base class of all ultracomm errors.  Its message starts with ``ultracomm`` (``ultracomm:``
    is prepended to a text that does not), so a user reading a log knows which library spoke."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and not args[0].startswith("ultracomm"):
            args = ("ultracomm: " + args[0], *args[1:])
        super().__init__(*args)


class InputError(UltracommError, ValueError):
    """An argument of a call is invalid: out of range, of the wrong device, or a ``vid``
    that is not in flight (plans, layouts, registered tensors and configuration have their own
    classes below)."""


class InputTypeError(UltracommError, TypeError):
    """An argument of a call has the wrong type; the message names it and the type to pass."""


class PlanError(UltracommError, ValueError):
    """A replica plan is invalid (bad shape, dtype, expert id, placement) or
    differs across ranks."""


class PlanMismatchError(PlanError):
    """Ranks are out of step: a peer runs another plan or operation than this rank at the same
    point -- another schedule digest in its window, a rejection it published, or an exchange
    that names another (layer, micro-batch slot, operation), e.g. a rank that runs its MoE
    layers in another order.  Raised before any byte moves between them, naming both sides.
    The C++ executors' digest check raises this class too (``ultracomm._core.PlanMismatchError``
    is it), so one ``except PlanMismatchError`` catches every form."""


class LayoutError(UltracommError, ValueError):
    """An expert layout (members, dtypes, alignment) is invalid."""


class ConfigError(UltracommError, ValueError):
    """An ``ULTRACOMM_*`` environment variable or per-call override is invalid."""


class RegistrationError(UltracommError, ValueError):
    """Tensors registered with a context do not match the expert layout."""


class UltracommTimeout(UltracommError, TimeoutError):
    """A wait for a peer passed ``ULTRACOMM_TIMEOUT_S``; the message names this rank, the
    operation and what (which ranks, flags) it waited for; on the host transport, when the
    rank waited for had started the operation, also the ranks whose ready flags show they never
    started it, the first to stop first (``ultracomm.transports.host.who_stopped``, which says where
    the window cannot know).  The group is unusable after it:
    create a new Context (and usually restart the job).

    ``Work.wait(timeout=...)`` raises it too when the caller's own ``timeout`` passes first;
    then only that wait gave up: the operation goes on and ``wait()`` may be called again."""


class PeerError(UltracommError):
    """Another rank failed a step of a collective setup or agreement; this rank raises too,
    naming that rank, the step and its error, so that no rank waits for it."""


class ClosedError(UltracommError):
    """The Context (or window) was closed; create a new one."""


def same_kind(cause: BaseException | None, text: str) -> UltracommError:
    """An error with ``text`` of the same ultracomm kind as ``cause``, for a failure that surfaces
    later than it happened (the next operation of a broken Context, a wrapped worker error):
    a timeout -- also a builtin ``TimeoutError`` -- stays an :class:`UltracommTimeout`, a plan
    mismatch a :class:`PlanMismatchError`, and so on; anything else is an :class:`UltracommError`."""
    kinds = (
        UltracommTimeout,
        PlanMismatchError,
        PlanError,
        PeerError,
        ClosedError,
        ConfigError,
        RegistrationError,
        LayoutError,
        InputError,
        InputTypeError,
    )
    for kind in kinds:
        if isinstance(cause, kind):
            return kind(text)
    if isinstance(cause, TimeoutError):
        return UltracommTimeout(text)
    return UltracommError(text)


def reason(error: BaseException) -> str:
    """The text of ``error`` without the ``ultracomm: `` prefix, for a message that already names
    its source: a command line's usage error (argparse's line names the tool), another ultracomm
    error that quotes it under its own prefix."""
    return str(error).removeprefix("ultracomm: ")
