"""SM budgets from per-CTA rates measured on the link the operation uses (issue 34)."""

from __future__ import annotations

import json

import pytest

from ultracomm.cuda.hwprofile import validate
from ultracomm.cuda.sm_budget import (
    FALLBACK_PER_CTA_BW,
    FALLBACK_SOURCES,
    choices_for_device,
    choose_sms,
    default_sms,
    per_cta_rate,
)


def _profile(**over):
    d = dict(
        schema="ultracomm.hwprofile/1",
        device="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        date="2026-12-04T00:00:00Z",
        torch="2.11.0+cu130",
        cuda="13.0",
        source="perf/bench_gpu.py",
        d2d_copy_bw=2.1e12,
        per_sm_copy_bw=39.1e9,
        per_sm_reduce_bw=4.4e9,
        sm_sweep=[[1, 39.1e9]],
        reduce_bw=None,
        torch_reduce_bw=None,
        flag_rtt_s=None,
        launch_s=None,
        relay_hop_s=[],
        chunk_overhead_s=None,
        hop_bw=None,
    )
    d.update(over)
    return d


def test_fallback_is_a_measured_per_cta_rate_with_its_source():
    assert FALLBACK_PER_CTA_BW == {"multicast": 34.5e9, "reduce": 14.6e9}
    assert "run2/bench_gpu.json sweep '16 CTAs'" in FALLBACK_SOURCES["multicast"]
    assert "run1/bench_gpu.json reduce 'k=2 fp32'" in FALLBACK_SOURCES["reduce"]
    # the committed rows reproduce the figures
    rows = json.load(open("perf/gpu/2026-12-04_nvidia-h200_run2/bench_gpu.json"))["rows"]
    r = next(r for r in rows if r["section"] == "sweep" and r["case"] == "16 CTAs")
    assert r["payload_bytes"] / r["time_s"] / r["ctas"] == pytest.approx(34.5e9, rel=2e-3)
    rows = json.load(open("perf/gpu/2026-12-04_nvidia-h200_run1/bench_gpu.json"))["rows"]
    r = next(r for r in rows if r["section"] == "reduce" and r["case"] == "k=2 fp32" and r["impl"] == "tile mover")
    assert r["traffic_bytes"] / r["time_s"] / r["ctas"] == pytest.approx(14.6e9, rel=3e-3)


@pytest.mark.parametrize(
    "link_bw, kind, device_sms, want",
    [
        (370e9, "multicast", 132, 11),  # ceil(10.72)
        (370e9, "reduce", 132, 26),  # ceil(25.34)
        (450e9, "multicast", 132, 14),  # ceil(13.04)
        (450e9, "reduce", 132, 31),  # ceil(30.82)
        (740e9, "multicast", 148, 22),  # ceil(21.45)
        (740e9, "reduce", 148, 32),  # ceil(50.7) capped at 32
        (69e9, "multicast", 132, 2),  # exact multiple: no extra CTA
        (370e9, "reduce", 20, 20),  # capped by the device
        (1e9, "multicast", 132, 1),
    ],
)
def test_budget_without_profile(link_bw, kind, device_sms, want):
    c = choose_sms(kind, 0, link_bw, device_sms)
    assert c.sms == want
    assert "measured per-CTA fallback" in c.source and FALLBACK_SOURCES[kind] in c.source


@pytest.mark.parametrize(
    "link_bw, rate, want", [(370e9, 25e9, 15), (370e9, 30e9, 13), (370e9, 37e9, 10), (450e9, 60e9, 8), (370e9, 5e9, 32)]
)
def test_budget_from_given_rates(link_bw, rate, want):
    assert default_sms(link_bw, rate, 132) == want
    prof = validate(_profile(per_cta_bw={"nvlink": {"multicast": rate, "reduce": rate}}), "p.json")
    for kind in ("multicast", "reduce"):
        assert choose_sms(kind, 0, link_bw, 132, prof).sms == want


def test_profile_overrides_the_fallback_on_its_link_only():
    prof = validate(_profile(per_cta_bw={"nvlink": {"multicast": 25e9}}), "p.json")
    mc = choose_sms("multicast", 0, 370e9, 132, prof)
    assert mc.sms == 15 and "per_cta_bw[nvlink][multicast]=2.5e+10 B/s from p.json (NVIDIA H200" in mc.source
    rd = choose_sms("reduce", 0, 370e9, 132, prof)  # no nvlink reduce figure: the fallback
    assert rd.sms == 26 and "fallback" in rd.source
    # local (loopback): the profile's one-CTA HBM figures; reduce's output rate counted as traffic (x4)
    assert per_cta_rate("multicast", "local", prof)[0] == 39.1e9
    assert per_cta_rate("reduce", "local", prof)[0] == pytest.approx(17.6e9)
    assert choose_sms("multicast", 0, 370e9, 132, prof, link="local").sms == 10
    assert choose_sms("reduce", 0, 370e9, 132, prof, link="local").sms == 22
    # a legacy profile (no per_cta_bw) says nothing about NVLink
    old = validate(_profile(), "old.json")
    assert old.per_cta_bw == {} and "per_cta_bw" not in old.to_dict()
    assert choose_sms("multicast", 0, 370e9, 132, old).sms == 11
    assert choose_sms("reduce", 3, 370e9, 132, prof).sms == 3  # configured wins


def test_choices_for_device_reads_the_profile(tmp_path, monkeypatch):
    from ultracomm.cuda import hwprofile

    (tmp_path / "h200_profile.json").write_text(
        json.dumps(_profile(per_cta_bw={"nvlink": {"multicast": 37e9, "reduce": 20e9}}))
    )
    monkeypatch.setattr(hwprofile, "DEFAULT_DIR", str(tmp_path))
    mc, rd = choices_for_device(0, 0, 370e9, 132, "NVIDIA H200")
    assert (mc.sms, rd.sms) == (10, 19)
    mc, rd = choices_for_device(0, 0, 370e9, None, None)  # no device: the fallback
    assert (mc.sms, rd.sms) == (11, 26)
    assert validate(json.loads((tmp_path / "h200_profile.json").read_text())).to_dict()["per_cta_bw"] == {
        "nvlink": {"multicast": 37e9, "reduce": 20e9}
    }


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"pcie": {"multicast": 1e9}}, "has link 'pcie'"),
        ({"nvlink": {"gather": 1e9}}, "must map kinds"),
        ({"nvlink": {"reduce": 0}}, r"per_cta_bw\[nvlink\]\[reduce\]"),
        ([1], "must be an object"),
    ],
)
def test_profile_per_cta_bw_is_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        validate(_profile(per_cta_bw=bad))


def test_bad_link_or_kind():
    with pytest.raises(ValueError, match="link must be one of"):
        choose_sms("multicast", 0, 1e9, link="pcie")
    with pytest.raises(ValueError, match="kind must be"):
        choose_sms("gather", 0, 1e9)
