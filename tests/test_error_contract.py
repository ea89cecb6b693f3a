"""Issue 35's exception contract, on the CPU: a failure caused by a timeout is an
``UltracommTimeout`` also when the next operation of the broken Context raises it; every plan
mismatch is a ``PlanMismatchError`` whichever check finds it; a configuration that differs
across ranks is a ``ConfigError``; garbage on the load board names the rank that posted it; and
no builtin exception escapes for a cause ultracomm detected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import Context, LoopbackDomain, ReplicaPlan
from ultracomm.errors import (
    ClosedError,
    ConfigError,
    InputError,
    LayoutError,
    PeerError,
    PlanError,
    PlanMismatchError,
    RegistrationError,
    UltracommError,
    UltracommTimeout,
    same_kind,
)

from test_context import make_layout, masters_for

LAYOUT = make_layout(4, 4)
PLAN = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)


@pytest.mark.parametrize(
    "cause, kind",
    [
        (UltracommTimeout("t"), UltracommTimeout),
        (TimeoutError("t"), UltracommTimeout),
        (PlanMismatchError("m"), PlanMismatchError),
        (PlanError("p"), PlanError),
        (PeerError("x"), PeerError),
        (ClosedError("c"), ClosedError),
        (ConfigError("c"), ConfigError),
        (RegistrationError("r"), RegistrationError),
        (LayoutError("l"), LayoutError),
        (InputError("i"), InputError),
        (RuntimeError("r"), UltracommError),
        (None, UltracommError),
    ],
)
def test_a_later_error_keeps_its_cause_kind(cause, kind):
    err = same_kind(cause, "ultracomm: later")
    assert type(err) is kind and str(err) == "ultracomm: later"


def test_a_timeout_raised_by_the_next_operation_is_still_a_timeout():
    """Rank 1 never joins a grad_reduce: rank 0's asynchronous one times out; its next operation
    raises an UltracommTimeout (what `except UltracommTimeout` promises to catch) carrying the
    original text -- it was a plain UltracommError."""

    def body(group):
        with Context(group, LAYOUT, 1, 1, num_layers=1, max_microbatches=2, timeout_s=1.0) as ctx:
            ctx.register_masters(0, *masters_for(LAYOUT, ctx.rank, 1))
            vid = ctx.begin(0)
            ctx.weight_sync(vid, PLAN)
            if group.rank == 1:
                return None  # stalls: never reduces
            work = ctx.grad_reduce(vid, async_op=True, release=False)
            with pytest.raises(UltracommTimeout) as first:
                work.wait()
            with pytest.raises(UltracommTimeout) as later:
                ctx.restore(vid)
            return str(first.value), str(later.value)

    got = LoopbackDomain(2).run(body)[0]
    first, later = got
    assert "timed out" in first
    assert later.startswith("ultracomm: this Context failed earlier (") and first in later, later


def test_every_message_names_ultracomm():
    """Messages built without the prefix (the plan, layout and configuration checks wrote
    "slot_src[0, 0] = 99 is out of range", "ULTRACOMM_TILE_BYTES=... is invalid") get it."""
    assert str(PlanError("slot_src is bad")) == "ultracomm: slot_src is bad"
    assert str(ConfigError("ultracomm.profile: x")) == "ultracomm.profile: x"  # already names it
    assert str(UltracommTimeout("ultracomm: t")) == "ultracomm: t" and UltracommError().args == ()


def test_files_and_adapter_arguments_raise_ultracomm_errors(tmp_path):
    """A truncated hardware profile, a trace path that is not there and a DeepEP pool of size 0
    raised plain ValueErrors (the profile reader's TraceError was a ValueError only)."""
    from ultracomm.cuda.hwprofile import load_profile
    from ultracomm.integrations.deepep_lb import BufferAllocator
    from ultracomm.profile.trace import load_trace
    from ultracomm.profile.trace_checks import TraceError

    (tmp_path / "hw.json").write_text('{"schema": ')
    with pytest.raises(ConfigError, match=r"^ultracomm: cannot read hardware profile .*hw\.json: Expecting value"):
        load_profile(str(tmp_path / "hw.json"))
    with pytest.raises(TraceError, match=r"^ultracomm\.profile: .*nope does not exist$") as err:
        load_trace(tmp_path / "nope")
    assert isinstance(err.value, UltracommError) and isinstance(err.value, ValueError)
    assert str(TraceError("x: y")) == "ultracomm.profile: x: y"
    with pytest.raises(
        InputError, match=r"^ultracomm: a pool is \[num_redundant_experts, \.\.\.\] with positive sizes"
    ):
        BufferAllocator().allocate([0, 4], torch.float32)


def test_plans_that_differ_raise_plan_mismatch_under_agree():
    other = ReplicaPlan.make(np.array([[-1], [0]], np.int32), experts_per_rank=1)

    def body(group):
        with Context(group, LAYOUT, 1, 1, num_layers=1, plan_check="agree") as ctx:
            ctx.register_masters(0, *masters_for(LAYOUT, ctx.rank, 1))
            with pytest.raises(PlanMismatchError) as err:
                ctx.weight_sync(ctx.begin(0), PLAN if group.rank == 0 else other)
            return str(err.value)

    for text in LoopbackDomain(2).run(body):
        assert text == (
            "ultracomm: plan differs across ranks (ranks [0]; ranks [1]); every rank must pass the same plan"
        )


def test_a_configuration_that_differs_raises_config_error():
    def body(group):
        with pytest.raises(ConfigError) as err:
            Context(group, LAYOUT, 1, 1, num_layers=1, relay_mode="off" if group.rank == 0 else "force")
        return str(err.value)

    for text in LoopbackDomain(2).run(body):
        assert text.startswith("ultracomm: Context configuration differs across ranks (ranks [0]: ") and text.endswith(
            "every rank must pass the same Context configuration"
        ), text


def test_garbage_on_the_load_board_names_the_rank_that_posted_it():
    """A record that arrives with counts no sender posts (every sender checks its own: here rank
    1 writes its record by hand) surfaces as a PeerError naming that rank, not as the planner's
    PlanError without a rank."""
    import ctypes

    from ultracomm import _core
    from ultracomm.moe.loads import LoadBoard

    def body(group):
        with Context(group, LAYOUT, 2, 1, num_layers=1, timeout_s=10.0) as ctx:
            board = LoadBoard.for_context(ctx)
            try:
                if group.rank == 1:  # exchange 1's record in every board: tag 0, counts -7, then the flag
                    L = board.layout
                    for base in board.window.peer_bases:
                        ctypes.c_uint64.from_address(base + L.tag(1, 1)).value = 0
                        ctypes.c_int32.from_address(base + L.counts(1, 1)).value = -7
                        _core.store_release(base + L.record(1, 1), 1)
                    return None
                with pytest.raises(PeerError) as err:
                    board.gather(torch.ones(4, dtype=torch.int64), op="step(layer 0)")
                return str(err.value)
            finally:
                board.close()

    text = LoopbackDomain(2).run(body)[0]
    assert (
        text.startswith("ultracomm: rank 0 step(layer 0) (expert loads): ranks [1] posted counts outside 0..")
        and "(rank 1: -7.." in text
    ), text


def test_an_executor_error_record_that_is_not_a_timeout_is_an_ultracomm_error(monkeypatch):
    """The host executor's other error records (a corrupt task list) are a C++ std::runtime_error:
    Context.weight_sync raised it as a builtin RuntimeError, which 'except UltracommError' missed."""
    from ultracomm import _core

    text = "ultracomm: rank 0 weight_sync: task 3 (expert 0 chunk 0) lies outside its slot or the refs"

    def corrupt(*args, **kwargs):
        raise RuntimeError(text)

    monkeypatch.setattr(_core, "run_host", corrupt)

    def body(group):
        with Context(group, LAYOUT, 1, 1, num_layers=1, transport="host", timeout_s=5.0) as ctx:
            ctx.register_masters(0, *masters_for(LAYOUT, ctx.rank, 1))
            vid = ctx.begin(0)
            with pytest.raises(UltracommError) as err:
                ctx.weight_sync(vid, PLAN)
            return type(err.value), str(err.value)

    assert LoopbackDomain(2).run(body, timeout=60) == [(UltracommError, text)] * 2
