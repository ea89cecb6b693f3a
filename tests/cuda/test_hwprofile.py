"""Hardware profile schema: validation, round trip, the search the SM default and the simulator use."""

from __future__ import annotations

import json
import logging
import os

import pytest

from ultracomm.cuda.hwprofile import DEFAULT_DIR, SCHEMA, find_profile, load_profile, profile_paths, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def good(**over) -> dict:
    d = dict(
        schema=SCHEMA,
        device="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        date="2025-12-01T10:00:00Z",
        torch="2.11.0+cu130",
        cuda="13.0",
        source="perf/bench_gpu.py",
        d2d_copy_bw=2.1e12,
        per_sm_copy_bw=90e9,
        per_sm_reduce_bw=60e9,
        sm_sweep=[[1, 90e9], [2, 180e9], [4, 350e9]],
        reduce_bw=1.5e12,
        torch_reduce_bw=1.6e12,
        flag_rtt_s=1.2e-6,
        launch_s=2.5e-6,
        relay_hop_s=[[32768, 3e-6], [1048576, 9e-6]],
        chunk_overhead_s=2.8e-6,
        hop_bw=1.6e11,
    )
    d.update(over)
    return d


def write(path, d) -> str:
    path.write_text(json.dumps(d))
    return str(path)


def test_round_trip(tmp_path):
    p = write(tmp_path / "a_profile.json", good())
    prof = load_profile(p)
    assert prof.path == p and prof.sm_sweep == ((1, 90e9), (2, 180e9), (4, 350e9))
    assert prof.to_dict() == good()
    assert prof.fabric_overrides() == {"hbm_bw": 4.2e12, "launch_s": 2.5e-6, "chunk_overhead_s": 2.8e-6}
    none = validate(good(launch_s=None, chunk_overhead_s=None))
    assert none.fabric_overrides() == {"hbm_bw": 4.2e12}


@pytest.mark.parametrize(
    "over, field, why",
    [
        (dict(schema="ultracomm.hwprofile/0"), "schema", "must be 'ultracomm.hwprofile/1'"),
        (dict(device=""), "device", "must be a non-empty string"),
        (dict(sm_count=0), "sm_count", "must be an int >= 1"),
        (dict(sm_count=True), "sm_count", "must be an int >= 1"),
        (dict(d2d_copy_bw=None), "d2d_copy_bw", "must be a finite number > 0, got None"),
        (dict(d2d_copy_bw=float("nan")), "d2d_copy_bw", "must be a finite number > 0"),
        (dict(per_sm_copy_bw=0), "per_sm_copy_bw", "must be a finite number > 0 or null"),
        (dict(flag_rtt_s=-1e-6), "flag_rtt_s", "must be a finite number > 0 or null"),
        (dict(sm_sweep=[[2, 1e9], [1, 1e9]]), "sm_sweep", "must be sorted by its first element"),
        (dict(sm_sweep=[[1, 1e9], [1, 2e9]]), "sm_sweep", "without repeats"),
        (dict(relay_hop_s=[[0, 1e-6]]), "relay_hop_s", "[positive int, number] pairs"),
        (dict(relay_hop_s={"32768": 1e-6}), "relay_hop_s", "must be a list of [int, number] pairs, got dict"),
        (dict(extra=1), "extra", "is not part of the schema"),
    ],
)
def test_invalid_fields_are_named(over, field, why):
    with pytest.raises(ValueError) as ei:
        validate(good(**over), "x.json")
    msg = str(ei.value)
    assert msg.startswith(f"ultracomm: hardware profile x.json: field {field!r} ") and why in msg


def test_missing_field_is_named():
    d = good()
    del d["launch_s"], d["hop_bw"]
    with pytest.raises(ValueError, match=r"field 'hop_bw' is missing \(also \['launch_s'\]\)"):
        validate(d)


def test_find_profile_newest_of_the_device(tmp_path, caplog):
    write(tmp_path / "1_profile.json", good(date="2025-11-30T00:00:00Z", per_sm_copy_bw=1e9))
    write(tmp_path / "2_profile.json", good(date="2025-12-02T00:00:00Z", per_sm_copy_bw=2e9))
    write(tmp_path / "3_profile.json", good(date="2025-12-03T00:00:00Z", device="NVIDIA A100", per_sm_copy_bw=3e9))
    (tmp_path / "4_profile.json").write_text("{not json")
    (tmp_path / "notes.json").write_text("{}")  # not a profile name: ignored
    assert [p.rsplit("/", 1)[1] for p in profile_paths(str(tmp_path))] == [
        "1_profile.json",
        "2_profile.json",
        "3_profile.json",
        "4_profile.json",
    ]
    with caplog.at_level(logging.WARNING, logger="ultracomm"):
        assert find_profile("NVIDIA H200", str(tmp_path)).per_sm_copy_bw == 2e9
    assert (
        "cannot read hardware profile" in caplog.text and "4_profile.json" in caplog.text and "skipped" in caplog.text
    )
    assert find_profile(None, str(tmp_path)).per_sm_copy_bw == 3e9
    assert find_profile("NVIDIA B200", str(tmp_path)) is None
    assert find_profile(None, str(tmp_path / "empty")) is None


def test_explicit_path_must_be_valid(tmp_path):
    bad = tmp_path / "bad_profile.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        find_profile(path=str(bad))
    with pytest.raises(ValueError, match="cannot read hardware profile"):
        find_profile(path=str(tmp_path / "missing.json"))


def test_default_dir_is_the_checkouts_perf_gpu():
    assert DEFAULT_DIR == os.path.join(ROOT, "perf", "gpu")
