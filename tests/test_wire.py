"""The store exchange's byte format (ultracomm.wire, issue 23 item 7): every value ultracomm
exchanges round-trips exactly; a planted pickle, garbage, truncated or oversized messages are
refused with a clear error and never executed."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch.distributed as dist

from ultracomm import wire
from ultracomm.comm import _StoreBoard
from ultracomm.dataplane.domains import RankDomain
from ultracomm.errors import UltracommError


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


VALUES = [
    None,
    True,
    False,
    0,
    -1,
    (1 << 63) - 1,
    -(1 << 63),
    (1 << 64) - 1,
    0.5,
    float("-inf"),
    "",
    "ünïcode",
    b"\x00\xff",
    [],
    (),
    {},
    [1, (2, "x"), {"k": [None]}],
    ("arrived", "Context setup", "configuration", ("ExpertLayout(...)", 2, 1, (0, 0, 1, 1), 1 << 20, "auto")),
    np.arange(12, dtype=np.int64).reshape(3, 4),
    np.zeros((0, 5), np.float32),
    np.array([True, False]),
    np.array(7, dtype=np.uint64),
    RankDomain("", "host-a", "host-a", "host"),
    {"digest": 0xCBF29CE484222325, "names": ["/ultracomm-1-2"]},
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_values_round_trip_exactly(value):
    assert same(wire.decode(wire.encode(value)), value)


def test_numpy_scalars_travel_as_python_numbers():
    assert wire.decode(wire.encode([np.int32(3), np.float64(0.25), np.bool_(True)])) == [3, 0.25, True]


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), "a object cannot travel between ranks"),
        ({1: 2}, "dict key 1 is not a str"),
        (1 << 64, "int 18446744073709551616 is outside the int64/uint64 range"),
        (np.array(["a"]), "numpy array of dtype str32 with 1 dims cannot travel"),
    ],
)
def test_what_cannot_travel_is_refused_on_the_sender(value, message):
    with pytest.raises(TypeError, match="^ultracomm wire: " + message.replace("(", r"\(").replace(")", r"\)")):
        wire.encode(value)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ultracomm-wire-pwned",))


def bad_messages():
    good = wire.encode([1, "x"])
    deep = b"UCW1" + b"l\x01\x00\x00\x00" * 40 + b"N"
    return [
        (pickle.dumps(Payload()), "not an ultracomm message (starts with"),
        (b"", "not an ultracomm message"),
        (good[:-1], "truncated message"),
        (good + b"N", "1 trailing bytes after the value"),
        (b"UCW1Z", "unknown tag b'Z' at offset 4"),
        (b"UCW1l\xff\xff\xff\xff", "a sequence of 4294967295 items in 0 bytes"),
        (deep, "nesting deeper than 32"),
        (b"UCW1c" + wire.encode("Popen")[4:] + wire.encode({})[4:], "class 'Popen' may not travel"),
        (
            b"UCW1c" + wire.encode("RankDomain")[4:] + wire.encode({"host": "h"})[4:],
            "RankDomain needs fields ['declared', 'host', 'key', 'source'], got ['host']",
        ),
        (b"UCW1s\x02\x00\x00\x00\xff\xfe", "a str that is not UTF-8"),
        (b"UCW1a\x63\x01", "array dtype code 99 / 1 dims are not valid"),
    ]


@pytest.mark.parametrize("data, message", bad_messages(), ids=range(len(bad_messages())))
def test_malformed_messages_are_refused(data, message):
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert str(err.value).startswith("ultracomm wire: ") and message in str(err.value), str(err.value)


def test_a_pickle_planted_in_the_store_is_refused_and_never_runs(tmp_path):
    marker = "/tmp/ultracomm-wire-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    store = dist.HashStore()
    board = _StoreBoard(store)
    try:
        board.post("ultracomm/0/0", ("arrived", "op", "what", np.arange(3)))
        store.set("ultracomm/0/1", pickle.dumps(("arrived", "op", "what", Payload())))
        with pytest.raises(UltracommError) as err:
            board.read(["ultracomm/0/0", "ultracomm/0/1"])
        assert str(err.value).startswith(
            "ultracomm: the store value under 'ultracomm/0/1' is not one ultracomm wrote (ultracomm wire: not an "
            "ultracomm message"
        ), str(err.value)
        assert str(err.value).endswith("another process wrote into this process group's store")
        assert not os.path.exists(marker)
        assert same(board.read(["ultracomm/0/0"])[0], ("arrived", "op", "what", np.arange(3)))
    finally:
        board.stop()
