"""ultracomm.viewer: the payload's budgets and numbers, and the page in a real headless browser
(Debian's Chromium driven by Playwright's Python API; no browser download)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from ultracomm import build_schedule
from ultracomm import scenarios as workloads
from ultracomm.planners import Domain, get_planner
from ultracomm.profile import Profiler, from_routing_stats, load_trace
from ultracomm.viewer import render_html, write_html
from ultracomm.viewer.browser import find_chromium, launch
from ultracomm.viewer.payload import build_payload, step_bins

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "perf" / "out"
W, EPR, SLOTS, STEPS, LAYERS = 8, 4, 2, 6, 3
E = W * EPR
WB, GB = 9437184, 18874368


def _load(step: int, layer: int) -> np.ndarray:
    # one hot expert per (step, layer) carrying 40-70 % of the tokens: replicas and relay trees
    return workloads.hot_rank_load(
        W,
        E,
        200,
        2,
        0.4 + 0.1 * ((step + layer) % 4),
        13 * step + layer,
        hot_rank=(step + 2 * layer) % W,
        hot_experts=1,
    )


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """6 steps x 3 layers, one micro-batch, recorded plans (quota), relay trees (force) and times."""
    path = tmp_path_factory.mktemp("viewer") / "trace"
    with Profiler(path, meta={"model": "qwen3-30b-a3b"}) as prof:
        for step in range(STEPS):
            for layer in range(LAYERS):
                load = _load(step, layer)
                res = get_planner("quota")(load, Domain.flat(W, EPR), SLOTS)
                sched = build_schedule(res.plan, WB, GB, relay_mode="force")
                prof.record(
                    layer,
                    load=load,
                    plan=res,
                    schedule=sched,
                    times={
                        "weight_sync": (100 + 10 * layer + step) * 1e-6,
                        "restore": 90e-6,
                        "grad_reduce": (200 + step) * 1e-6,
                    },
                )
    return load_trace(path)


def _inflate(html: str) -> dict:
    m = re.search(
        r'<script id="uc-data" type="application/octet-stream" data-encoding="deflate-base64">([^<]*)</script>', html
    )
    return json.loads(zlib.decompress(base64.b64decode(m.group(1))))


def _heat(payload: dict, layer: int) -> np.ndarray:
    h = payload["heat"]
    q = np.frombuffer(base64.b64decode(h["layers"][str(layer)]["data"]), "<u2").reshape(h["rows"], h["cols"])
    return q * h["layers"][str(layer)]["scale"]


def test_payload_numbers(small):
    payload = build_payload(small)
    meta = payload["meta"]
    assert (meta["world"], meta["num_experts"], meta["steps"], meta["records"], meta["layers"]) == (
        W,
        E,
        STEPS,
        18,
        [0, 1, 2],
    )
    assert meta["planner"] == "recorded" and meta["planned_here"] == 0
    assert payload["heat"]["rows"] == STEPS and payload["heat"]["cols"] == E
    for layer in range(LAYERS):
        rows = [small.find(s, layer) for s in range(STEPS)]
        assert np.array_equal(_heat(payload, layer), small["expert_load"][rows])  # exact: one row per step
        ser = payload["series"]["layers"][str(layer)]
        assert ser["t_weight_sync"] == [pytest.approx((100 + 10 * layer + s) * 1e-3, rel=1e-5) for s in range(STEPS)]
        assert ser["imb_before"] == [pytest.approx(small.imbalance_before[r], rel=1e-5) for r in rows]
        samples = payload["detail"][str(layer)]
        assert [s["step"] for s in samples] == list(range(STEPS))
        for smp, r in zip(samples, rows):
            assert smp["before"] == small.rank_load_before[r].astype(int).tolist()
            assert smp["after"] == small["rank_load_after"][r].astype(int).tolist()
            assert smp["slot_src"] == small["slot_src"][r].tolist()
            mc = smp["mc"]
            assert [v * mc["unit"] for v in mc["egress"]] == small["multicast_egress"][r].tolist()
            assert mc["depth"] == small["multicast_tree_depth"][r].tolist()
            assert mc["lower_bound_bytes"] == small["multicast_lower_bound_bytes"][r]


def test_binning_means_per_step():
    counts = np.arange(10 * 2 * 8).reshape(10, 2, 8)
    tr = from_routing_stats(counts, 4)
    payload = build_payload(tr, planner="none", max_cells=2 * 8 * 3)  # 3 step bins per layer
    edges = step_bins(10, 3)
    assert edges.tolist() == [0, 3, 7, 10]
    assert payload["heat"]["step_bins"] == [[0, 2], [3, 6], [7, 9]]
    for layer in range(2):
        want = np.stack([counts[a:b, layer].mean(0) for a, b in zip(edges[:-1], edges[1:])])
        got = _heat(payload, layer)
        scale = payload["heat"]["layers"][str(layer)]["scale"]
        assert np.all(np.abs(got - want) <= scale / 2 + 1e-9)
    assert all(s["slot_src"] is None for v in payload["detail"].values() for s in v)


@pytest.fixture(scope="module")
def large():
    """1000 steps x 94 layers x 128 experts on 64 ranks, imported from routing statistics."""
    rng = np.random.default_rng(0)
    T, L, E_, W_ = 1000, 94, 128, 64
    base = rng.zipf(1.6, size=(L, E_)).clip(1, 50).astype(np.float64)
    base /= base.sum(1, keepdims=True)
    wave = 1 + 0.3 * np.sin(np.arange(T) / 50.0)
    counts = rng.poisson(base[None] * (8192 * 8 * W_) * wave[:, None, None]).astype(np.int32)
    tr = from_routing_stats(counts, W_)
    return tr, render_html(tr)


@pytest.mark.slow
def test_large_trace_stays_bounded(large):
    tr, html = large
    payload = _inflate(html)
    h = payload["heat"]
    assert len(tr) == 94_000
    assert len(html) < 5_000_000, f"report is {len(html) / 1e6:.1f} MB"
    assert h["rows"] * h["cols"] * len(h["layers"]) <= 1_000_000 and h["cols"] == 128
    assert len(payload["series"]["x"]) <= 256
    samples = [s for v in payload["detail"].values() for s in v]
    assert len(samples) <= 800 and all(s["plan_source"] == "quota" for s in samples)
    assert payload["meta"]["planned_here"] == len(samples)
    # binned heat = the mean load per step of each bin
    layer = 17
    edges = step_bins(1000, h["rows"])
    el = tr["expert_load"].reshape(1000, 94, 128)[:, layer]
    want = np.stack([el[a:b].mean(0) for a, b in zip(edges[:-1], edges[1:])])
    assert np.all(np.abs(_heat(payload, layer) - want) <= h["layers"][str(layer)]["scale"] / 2 + 1e-6)


def test_cli_writes_report(small, tmp_path):
    out = tmp_path / "r.html"
    res = subprocess.run(
        [sys.executable, "-m", "ultracomm.viewer", small.path, "-o", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "18 records" in res.stdout and out.stat().st_size > 10_000
    assert _inflate(out.read_text())["meta"]["records"] == 18
    page = out.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # offline
    bad = subprocess.run(
        [sys.executable, "-m", "ultracomm.viewer", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr


# ----------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright; scripts/setup.sh does)"
    )
    if find_chromium() is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; scripts/setup.sh installs it where it can)")
    with sync_api.sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


def _open(browser, path: Path, width: int = 1400):
    page = browser.new_page(viewport={"width": width, "height": 1000})
    msgs: list = []
    page.on("console", lambda m: msgs.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: msgs.append(f"pageerror: {e}"))
    page.on(
        "request",
        lambda r: msgs.append(f"request: {r.url}") if not r.url.startswith(("file:", "data:", "blob:")) else None,
    )
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return page, msgs


def _attr_values(page, selector: str, attr: str) -> list:
    return page.eval_on_selector_all(selector, f"ns => ns.map(n => n.getAttribute('{attr}'))")


def test_page_in_browser(browser, small):
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "viewer_small.html"
    write_html(small, path)
    page, msgs = _open(browser, path)
    for pid in (
        "panel-heatmap",
        "panel-rankload",
        "panel-imbalance",
        "panel-placement",
        "panel-tree",
        "panel-egress",
        "panel-times",
    ):
        assert page.locator(f"#{pid}").is_visible(), pid
    chips = dict(zip(_attr_values(page, ".chip", "data-key"), _attr_values(page, ".chip", "data-value")))
    assert {k: chips[k] for k in ("world", "experts", "slots", "layers", "steps", "records")} == {
        "world": "8",
        "experts": "32",
        "slots": "2",
        "layers": "3",
        "steps": "6",
        "records": "18",
    }

    # the first sample shown is layer 0's most imbalanced record
    rows0 = [small.find(s, 0) for s in range(STEPS)]
    i = rows0[int(np.argmax(small.imbalance_before[rows0]))]
    assert page.get_attribute("#step-range", "data-step") == str(small["step"][i])
    check_detail(page, small, i)

    # hover a heatmap cell: the tooltip holds that step's load of that expert
    left, top, pw, ph = map(float, page.get_attribute("#heatmap", "data-plot").split(","))
    box = page.locator("#heatmap").bounding_box()
    step, col = 4, int(np.argmax(small["expert_load"][rows0[4]]))
    page.mouse.move(box["x"] + left + (col + 0.5) * pw / E, box["y"] + top + (step + 0.5) * ph / STEPS)
    tip = page.text_content("#tooltip")
    want = int(small["expert_load"][rows0[4]][col])
    assert f"step {step}" in tip and f"expert {col} (home rank {col // EPR}): {want:,} tokens" in tip
    assert page.is_visible("#tooltip")

    # another layer changes the heatmap
    before = page.evaluate("document.getElementById('heatmap').toDataURL()")
    assert page.get_attribute("#heatmap", "data-sum") == str(int(small["expert_load"][rows0].sum()))
    page.select_option("#layer-select", "2")
    assert page.get_attribute("#heatmap", "data-layer") == "2"
    rows2 = [small.find(s, 2) for s in range(STEPS)]
    assert page.get_attribute("#heatmap", "data-sum") == str(int(small["expert_load"][rows2].sum()))
    assert page.evaluate("document.getElementById('heatmap').toDataURL()") != before
    on_linear = page.evaluate("document.getElementById('heatmap').toDataURL()")
    page.select_option("#heat-scale", "log")  # another colour scale: other pixels, same numbers
    assert page.evaluate("document.getElementById('heatmap').toDataURL()") != on_linear
    assert page.get_attribute("#heatmap", "data-sum") == str(int(small["expert_load"][rows2].sum()))
    i2 = small.find(int(small["step"][i]), 2)  # the same step is kept
    check_detail(page, small, i2)

    # the step slider and the op times
    page.eval_on_selector("#step-range", "n => { n.value = '0'; n.dispatchEvent(new Event('input')); }")
    assert page.get_attribute("#step-range", "data-step") == "0"
    check_detail(page, small, rows2[0])
    dots = [float(v) for v in _attr_values(page, "#times g[data-series='weight_sync (measured)'] circle", "data-value")]
    assert dots == [pytest.approx((120 + s) * 1e-3, rel=1e-5) for s in range(STEPS)]

    # grad_reduce: ingress bars against the reduce lower bound, tree edges point up
    page.select_option("#op-select", "rd")
    vals = [int(v) for v in _attr_values(page, "#egress rect[data-rank]", "data-value")]
    assert vals == small["reduce_ingress"][rows2[0]].tolist()
    assert int(page.get_attribute("#egress .bound-line", "data-value")) == small["reduce_lower_bound_bytes"][rows2[0]]
    page.screenshot(path=str(OUT / "viewer_small.png"), full_page=True)
    assert (OUT / "viewer_small.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert msgs == []


def check_detail(page, trace, i: int) -> None:
    """The per-rank panels show row ``i`` of ``trace`` (multicast selected)."""
    before = [float(v) for v in _attr_values(page, "#rankload g[data-series='before'] rect", "data-value")]
    after = [float(v) for v in _attr_values(page, "#rankload g[data-series='after'] rect", "data-value")]
    assert before == trace.rank_load_before[i].tolist() and after == trace["rank_load_after"][i].tolist()
    assert page.text_content("#imb-before") == f"{trace.imbalance_before[i]:.3f}"
    assert page.text_content("#imb-after") == f"{trace.imbalance_after[i]:.3f}"
    cells = zip(
        _attr_values(page, "#placement g.cell", "data-rank"),
        _attr_values(page, "#placement g.cell", "data-slot"),
        _attr_values(page, "#placement g.cell", "data-expert"),
    )
    src = trace["slot_src"][i]
    assert sorted((int(r), int(s), int(e)) for r, s, e in cells) == [
        (r, s, int(src[r, s])) for r in range(W) for s in range(SLOTS)
    ]
    if page.input_value("#op-select") == "mc":
        vals = [int(v) for v in _attr_values(page, "#egress rect[data-rank]", "data-value")]
        assert vals == trace["multicast_egress"][i].tolist()
        assert int(page.get_attribute("#egress .bound-line", "data-value")) == trace["multicast_lower_bound_bytes"][i]
    # the relay tree of the most replicated expert (ties: lowest id)
    filled = src[src >= 0]
    counts = np.bincount(filled, minlength=E)
    e = int(np.argmax(counts))
    assert page.input_value("#expert-select") == str(e)
    slots = np.argwhere(src == e)
    ranks = sorted(int(r) for r in _attr_values(page, "#tree g.node:not(.master)", "data-rank"))
    assert ranks == sorted(int(r) for r, _ in slots)
    assert page.get_attribute("#tree g.node.master", "data-rank") == str(e // EPR)
    depths = sorted(int(d) for d in _attr_values(page, "#tree g.node:not(.master)", "data-depth"))
    assert depths == sorted(int(trace["multicast_tree_depth"][i][r, s]) for r, s in slots)
    parents = sorted(
        zip(
            map(int, _attr_values(page, "#tree line.edge", "data-from")),
            map(int, _attr_values(page, "#tree line.edge", "data-to")),
        )
    )
    assert parents == sorted(
        (
            int(trace["multicast_parent_rank"][i][r, s]) if trace["multicast_parent_slot"][i][r, s] >= 0 else e // EPR,
            int(r),
        )
        for r, s in slots
    )


@pytest.mark.slow
def test_large_page_in_browser(browser, large):
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "viewer_large.html"
    path.write_text(large[1])
    page, msgs = _open(browser, path)
    assert page.get_attribute("#heatmap", "data-rows") == str(_inflate(large[1])["heat"]["rows"])
    before = page.evaluate("document.getElementById('heatmap').toDataURL()")
    page.select_option("#layer-select", "93")
    assert page.get_attribute("#heatmap", "data-layer") == "93"
    assert page.evaluate("document.getElementById('heatmap').toDataURL()") != before
    assert page.locator("#placement g.cell").count() == 64 * 2
    page.screenshot(path=str(OUT / "viewer_large.png"), full_page=True)
    assert msgs == []


def test_cli_screenshot(small, tmp_path):
    # a subprocess: Playwright's sync API cannot start inside the module's running browser
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if find_chromium() is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultracomm.viewer",
            small.path,
            "-o",
            str(tmp_path / "r.html"),
            "--screenshot",
            str(tmp_path / "r.png"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"wrote {tmp_path / 'r.png'}" in res.stdout and "the page reported" not in res.stdout
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1400  # IHDR width
