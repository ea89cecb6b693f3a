/* ultracomm load-profile viewer: draws the payload embedded in #uc-data (see viewer/payload.py).
   No library, no network: canvas for the heatmap, SVG for the charts. */
(function () {
  "use strict";
  var SVGNS = "http://www.w3.org/2000/svg";
  var D, M, W, E, EPR, state, heatCache = {};

  // The payload is deflated JSON in base64 (viewer/__init__.py); the browser inflates it.
  function inflatePayload() {
    var node = document.getElementById("uc-data"), text = node.textContent.trim();
    if (node.getAttribute("data-encoding") !== "deflate-base64") return Promise.resolve(JSON.parse(text));
    if (typeof DecompressionStream === "undefined")
      return Promise.reject(new Error("this browser has no DecompressionStream (Chrome 80+, Firefox 113+, Safari 16.4+)"));
    var bin = atob(text), u8 = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) u8[i] = bin.charCodeAt(i);
    var stream = new Blob([u8]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).text().then(JSON.parse);
  }

  // ------------------------------------------------------------------ helpers
  function $(id) { return document.getElementById(id); }
  function el(tag, attrs, parent, text) {
    var n = document.createElement(tag);
    setAttrs(n, attrs);
    if (text !== undefined) n.textContent = text;
    if (parent) parent.appendChild(n);
    return n;
  }
  function sv(tag, attrs, parent, text) {
    var n = document.createElementNS(SVGNS, tag);
    setAttrs(n, attrs);
    if (text !== undefined) n.textContent = text;
    if (parent) parent.appendChild(n);
    return n;
  }
  function setAttrs(n, attrs) {
    if (!attrs) return;
    for (var k in attrs) if (attrs[k] !== undefined && attrs[k] !== null) n.setAttribute(k, attrs[k]);
  }
  function clear(n) { while (n.firstChild) n.removeChild(n.firstChild); return n; }
  function fmtInt(v) { return v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"); }
  function fmtNum(v, d) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    if (Math.abs(v - Math.round(v)) < 1e-9 && Math.abs(v) < 1e9) return fmtInt(v);
    return v.toLocaleString("en-US", { maximumFractionDigits: d === undefined ? 1 : d });
  }
  function fmtRatio(v) { return v === null || v === undefined || !isFinite(v) ? "–" : v.toFixed(3); }
  function fmtBytes(v) {
    if (v === null || v === undefined) return "–";
    var u = ["B", "KB", "MB", "GB", "TB"], i = 0;
    while (Math.abs(v) >= 1000 && i < u.length - 1) { v /= 1000; i++; }
    return (i ? sig3(v) : String(v)) + " " + u[i];
  }
  function fmtMs(v) { return v === null || v === undefined || !isFinite(v) ? "–" : (v < 1 ? v.toPrecision(3) : v.toFixed(2)) + " ms"; }
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) hi = lo + 1;
    var span = hi - lo, step = Math.pow(10, Math.floor(Math.log10(span / n)));
    var err = span / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [], t = Math.ceil(lo / step) * step;
    for (; t <= hi + step * 1e-9; t += step) out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    return out;
  }
  function sig3(x) { return String(parseFloat(x.toPrecision(3))); }
  function tickLabel(v) {
    var a = Math.abs(v);
    if (a >= 1e9) return sig3(v / 1e9) + "G";
    if (a >= 1e6) return sig3(v / 1e6) + "M";
    if (a >= 1e4) return sig3(v / 1e3) + "k";
    return String(+v.toPrecision(4));
  }
  function rankHue(r) { return (r * 137.508) % 360; }
  function rankColor(r, l) { return "hsl(" + rankHue(r).toFixed(1) + ",58%," + (l || 62) + "%)"; }
  function homeOf(e) { return Math.floor(e / EPR); }
  function mean(a) { var s = 0; for (var i = 0; i < a.length; i++) s += a[i]; return a.length ? s / a.length : 0; }
  function maxOf(a) { var m = -Infinity; for (var i = 0; i < a.length; i++) if (a[i] !== null && a[i] > m) m = a[i]; return m; }

  // viridis, 5 stops interpolated
  var VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  var LUT = (function () {
    var lut = new Uint8ClampedArray(256 * 3);
    for (var i = 0; i < 256; i++) {
      var x = i / 255 * 4, k = Math.min(3, Math.floor(x)), f = x - k;
      for (var c = 0; c < 3; c++) lut[i * 3 + c] = VIRIDIS[k][c] + (VIRIDIS[k + 1][c] - VIRIDIS[k][c]) * f;
    }
    return lut;
  })();
  // colour = f(value) / f(max): sqrt and log lift the cold experts out of the dark end
  var COLOUR_SCALES = { linear: function (v) { return v; }, sqrt: Math.sqrt, log: Math.log1p };
  function lutCss(t) {
    var i = Math.max(0, Math.min(255, Math.round(t * 255))) * 3;
    return "rgb(" + LUT[i] + "," + LUT[i + 1] + "," + LUT[i + 2] + ")";
  }

  // ------------------------------------------------------------------ tooltip
  var tip = $("tooltip");
  function showTip(text, x, y) {
    tip.textContent = text;
    tip.style.display = "block";
    var w = tip.offsetWidth, h = tip.offsetHeight;
    var left = x + 14, top = y + 14;
    if (left + w > window.innerWidth - 4) left = x - w - 14;
    if (top + h > window.innerHeight - 4) top = y - h - 14;
    tip.style.left = Math.max(4, left) + "px";
    tip.style.top = Math.max(4, top) + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  document.addEventListener("mousemove", function (ev) {
    var t = ev.target;
    if (t && t.closest) {
      var n = t.closest("[data-tip]");
      if (n) { showTip(n.getAttribute("data-tip"), ev.clientX, ev.clientY); return; }
    }
    if (t !== $("heatmap")) hideTip();
  });

  // ------------------------------------------------------------------ data access
  function samples() { return D.detail[String(state.layer)] || []; }
  function sample() { var s = samples(); return s.length ? s[Math.min(state.sample, s.length - 1)] : null; }
  function heatLayer(layer) {
    var key = String(layer);
    if (!heatCache[key]) {
      var h = D.heat.layers[key], bin = atob(h.data), u8 = new Uint8Array(bin.length);
      for (var i = 0; i < bin.length; i++) u8[i] = bin.charCodeAt(i);
      var q = new Uint16Array(u8.buffer), sum = 0, mx = 0;
      for (var j = 0; j < q.length; j++) { sum += q[j]; if (q[j] > mx) mx = q[j]; }
      heatCache[key] = { q: q, scale: h.scale, sum: sum, qmax: mx, empty: h.empty_rows };
    }
    return heatCache[key];
  }
  function rowOfStep(step) {
    var b = D.heat.step_bins;
    for (var i = 0; i < b.length; i++) if (step >= b[i][0] && step <= b[i][1]) return i;
    return -1;
  }

  // ------------------------------------------------------------------ summary and controls
  function chip(parent, key, value, label, cls) {
    var c = el("span", { "class": "chip" + (cls ? " " + cls : ""), "data-key": key, "data-value": value }, parent);
    el("b", null, c, String(value));
    c.appendChild(document.createTextNode(" " + label));
  }
  function initSummary() {
    $("title").textContent = D.title;
    document.title = D.title;
    var s = clear($("summary"));
    chip(s, "world", W, "ranks");
    chip(s, "experts", E, "experts (" + EPR + "/rank)");
    chip(s, "slots", M.slots_per_rank, "replica slots/rank");
    chip(s, "layers", M.layers.length, "layers");
    chip(s, "steps", M.steps, "steps (" + M.first_step + "–" + M.last_step + ")");
    chip(s, "records", M.records, "records");
    chip(s, "microbatches", M.microbatches, "micro-batches");
    if (M.imbalance_before_mean !== null) chip(s, "imbalance_before", fmtRatio(M.imbalance_before_mean), "mean imbalance before", "warn");
    if (M.imbalance_after_mean !== null) chip(s, "imbalance_after", fmtRatio(M.imbalance_after_mean), "after (recorded)", "good");
    if (M.planner) chip(s, "planner", M.planner, M.planned_here ? "plans (made by the viewer for the samples)" : "plans");
    var f = $("footer");
    f.textContent = "Source: " + M.source + " · detail: " + M.detail + (M.fabric ? " · plans made for " + M.fabric : "") +
      (M.model ? " · model " + M.model : "") + " · heatmap: " + D.heat.rows + " step bins × " + D.heat.cols +
      " experts per layer · per-rank panels: sampled records (step slider)" +
      (M.late_ops ? " · " + M.late_ops + " op time(s) arrived after their step was written" : "") +
      " · generated by ultracomm.viewer; predicted and lower-bound times come from the schedule's cost model, measured times from the recorder.";
  }
  function initControls() {
    var ls = $("layer-select");
    M.layers.forEach(function (l) {
      var n = samples_of(l).length;
      el("option", { value: l }, ls, "layer " + l + (n ? "" : " (no samples)"));
    });
    ls.addEventListener("change", function () { setLayer(+ls.value); });
    $("layer-prev").addEventListener("click", function () { stepLayer(-1); });
    $("layer-next").addEventListener("click", function () { stepLayer(1); });
    $("step-range").addEventListener("input", function () { state.sample = +this.value; renderDetail(); renderHeatMarker(); renderSeries(); });
    $("expert-select").addEventListener("change", function () { state.expert = +this.value; renderPlacement(); renderTree(); });
    $("op-select").addEventListener("change", function () { state.op = this.value; renderTree(); renderEgress(); });
    $("heat-scale").addEventListener("change", renderHeat);
  }
  function samples_of(l) { return D.detail[String(l)] || []; }
  function stepLayer(d) {
    var i = M.layers.indexOf(state.layer) + d;
    if (i >= 0 && i < M.layers.length) setLayer(M.layers[i]);
  }
  function worstSample(list) {
    var best = 0, v = -Infinity;
    list.forEach(function (s, i) { if (s.imb_before !== null && s.imb_before > v) { v = s.imb_before; best = i; } });
    return best;
  }
  function setLayer(l) {
    var cur = sample();
    state.layer = l;
    $("layer-select").value = String(l);
    var list = samples();
    if (cur && list.length) {  // keep the nearest step
      var best = 0, d = Infinity;
      list.forEach(function (s, i) { var x = Math.abs(s.step - cur.step) + 0.01 * Math.abs(s.mb - cur.mb); if (x < d) { d = x; best = i; } });
      state.sample = best;
    } else state.sample = worstSample(list);
    renderAll();
  }
  function selectStep(step) {
    var list = samples(), best = 0, d = Infinity;
    list.forEach(function (s, i) { var x = Math.abs(s.step - step); if (x < d) { d = x; best = i; } });
    state.sample = best;
    renderDetail(); renderHeatMarker(); renderSeries();
  }

  // ------------------------------------------------------------------ heatmap
  var HM = { left: 64, right: 10, top: 8, bottom: 34 };
  var heatGeom = null;
  function renderHeat() {
    var cv = $("heatmap"), h = heatLayer(state.layer), rows = D.heat.rows, cols = D.heat.cols;
    var cssW = Math.max(320, cv.parentNode.clientWidth || 900);
    var ctx = cv.getContext("2d");
    ctx.font = "11px system-ui, sans-serif";
    var labelW = 0;
    D.heat.step_bins.forEach(function (b) { labelW = Math.max(labelW, ctx.measureText(stepBinLabel(b)).width); });
    HM.left = Math.ceil(labelW) + 30;
    var plotW = cssW - HM.left - HM.right;
    var cellH = Math.max(2, Math.min(18, Math.floor(360 / rows)));
    var plotH = Math.max(60, cellH * rows);
    var cssH = plotH + HM.top + HM.bottom, dpr = window.devicePixelRatio || 1;
    cv.width = Math.round(cssW * dpr); cv.height = Math.round(cssH * dpr);
    cv.style.height = cssH + "px";
    ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    // cells, at native resolution, then scaled
    var img = new ImageData(cols, rows), px = img.data, f = COLOUR_SCALES[$("heat-scale").value], fmax = f(Math.max(1, h.qmax));
    for (var r = 0; r < rows; r++) for (var c = 0; c < cols; c++) {
      var v = h.q[r * cols + c], o = (r * cols + c) * 4, li = Math.round(f(v) / fmax * 255) * 3;
      px[o] = LUT[li]; px[o + 1] = LUT[li + 1]; px[o + 2] = LUT[li + 2]; px[o + 3] = 255;
    }
    h.empty.forEach(function (r) { for (var c = 0; c < cols; c++) { var o = (r * cols + c) * 4; px[o] = px[o + 1] = px[o + 2] = 235; } });
    var off = document.createElement("canvas");
    off.width = cols; off.height = rows;
    off.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, HM.left, HM.top, plotW, plotH);
    // home-rank separators
    var cw = plotW / cols;
    ctx.strokeStyle = "rgba(255,255,255,0.55)"; ctx.lineWidth = 1;
    if (!D.heat.expert_bins && EPR > 1 && cw * EPR >= 6) {
      for (var e = EPR; e < E; e += EPR) {
        var x = Math.round(HM.left + e * cw) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, HM.top); ctx.lineTo(x, HM.top + plotH); ctx.stroke();
      }
    }
    // axes
    ctx.fillStyle = "#52606d"; ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    var eTicks = niceTicks(0, E - 1, Math.max(2, Math.floor(plotW / 70)));
    eTicks.forEach(function (t) {
      if (t > E - 1) return;
      var col = D.heat.expert_bins ? colOfExpert(t) : t;
      ctx.fillText(String(t), HM.left + (col + 0.5) * cw, HM.top + plotH + 4);
    });
    ctx.fillText("expert (lines: home-rank boundaries)", HM.left + plotW / 2, HM.top + plotH + 18);
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    var rh = plotH / rows, every = Math.max(1, Math.ceil(14 / rh));
    for (var rr = 0; rr < rows; rr += every) {
      ctx.fillText(stepBinLabel(D.heat.step_bins[rr]), HM.left - 10, HM.top + (rr + 0.5) * rh);
    }
    ctx.save(); ctx.translate(12, HM.top + plotH / 2); ctx.rotate(-Math.PI / 2); ctx.textAlign = "center";
    ctx.fillText("step", 0, 0); ctx.restore();
    var base = document.createElement("canvas");  // the drawing without the step marker, redrawn under it
    base.width = cv.width; base.height = cv.height;
    base.getContext("2d").drawImage(cv, 0, 0);
    heatGeom = { plotW: plotW, plotH: plotH, rows: rows, cols: cols, base: base };
    cv.setAttribute("data-layer", String(state.layer));
    cv.setAttribute("data-sum", String(h.sum));
    cv.setAttribute("data-rows", String(rows));
    cv.setAttribute("data-cols", String(cols));
    cv.setAttribute("data-plot", [HM.left, HM.top, plotW, plotH].join(","));  // css px: left, top, width, height
    var mxv = h.qmax * h.scale;
    $("heat-caption").innerHTML = "";
    var cap = $("heat-caption");
    cap.appendChild(document.createTextNode("layer "));
    el("b", null, cap, String(state.layer));
    cap.appendChild(document.createTextNode(" · tokens per step, " + (rows < M.steps ? "mean of " + (M.steps / rows).toFixed(1) + " steps per row" : "one row per step") +
      " · max " + fmtNum(mxv) + " · click a row to pick its step"));
    var lg = clear($("heat-legend"));
    el("span", null, lg, "0");
    var bar = el("span", { "class": "bar" }, lg);
    var stops = [];
    for (var i = 0; i <= 8; i++) stops.push(lutCss(i / 8) + " " + (i * 12.5) + "%");
    bar.style.background = "linear-gradient(to right," + stops.join(",") + ")";
    el("span", null, lg, fmtNum(mxv) + " tokens / step" + ($("heat-scale").value === "linear" ? "" : " (" + $("heat-scale").selectedOptions[0].text + " scale)"));
    renderHeatMarker();
  }
  function stepBinLabel(b) { return b[0] === b[1] ? String(b[0]) : b[0] + "–" + b[1]; }
  function colOfExpert(e) {
    var b = D.heat.expert_bins;
    for (var i = 0; i < b.length; i++) if (e >= b[i][0] && e <= b[i][1]) return i;
    return b.length - 1;
  }
  function renderHeatMarker() {
    if (!heatGeom) return;
    var cv = $("heatmap"), ctx = cv.getContext("2d"), dpr = window.devicePixelRatio || 1;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, cv.width, cv.height);
    ctx.drawImage(heatGeom.base, 0, 0);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    var s = sample();
    if (!s) return;
    var r = rowOfStep(s.step);
    if (r < 0) return;
    var rh = heatGeom.plotH / heatGeom.rows;
    ctx.strokeStyle = "#ffffff"; ctx.lineWidth = 2;
    ctx.strokeRect(HM.left - 1, HM.top + r * rh - 1, heatGeom.plotW + 2, rh + 2);
    ctx.fillStyle = "#dc2626";
    ctx.beginPath(); ctx.moveTo(HM.left - 2, HM.top + (r + 0.5) * rh);
    ctx.lineTo(HM.left - 8, HM.top + (r + 0.5) * rh - 4); ctx.lineTo(HM.left - 8, HM.top + (r + 0.5) * rh + 4); ctx.fill();
  }
  function heatCell(ev) {
    if (!heatGeom) return null;
    var cv = $("heatmap"), rect = cv.getBoundingClientRect();
    var x = ev.clientX - rect.left - HM.left, y = ev.clientY - rect.top - HM.top;
    if (x < 0 || y < 0 || x >= heatGeom.plotW || y >= heatGeom.plotH) return null;
    return { r: Math.floor(y / heatGeom.plotH * heatGeom.rows), c: Math.floor(x / heatGeom.plotW * heatGeom.cols) };
  }
  function initHeatEvents() {
    var cv = $("heatmap");
    cv.addEventListener("mousemove", function (ev) {
      var cell = heatCell(ev);
      if (!cell) { hideTip(); return; }
      var h = heatLayer(state.layer), b = D.heat.step_bins[cell.r];
      var v = h.q[cell.r * heatGeom.cols + cell.c] * h.scale;
      var ex = D.heat.expert_bins ? D.heat.expert_bins[cell.c] : [cell.c, cell.c];
      var steps = b[0] === b[1] ? "step " + b[0] : "steps " + b[0] + "–" + b[1] + " (mean per step)";
      var exs = ex[0] === ex[1] ? "expert " + ex[0] + " (home rank " + homeOf(ex[0]) + ")" : "experts " + ex[0] + "–" + ex[1] + " (mean)";
      var empty = h.empty.indexOf(cell.r) >= 0;
      showTip("layer " + state.layer + " · " + steps + "\n" + exs + ": " + (empty ? "no record" : fmtNum(v, 1) + " tokens" + (h.scale === 1 ? "" : " (±" + fmtNum(h.scale / 2, 2) + ")")), ev.clientX, ev.clientY);
      cv.setAttribute("data-hover", empty ? "" : String(v));
    });
    cv.addEventListener("mouseleave", hideTip);
    cv.addEventListener("click", function (ev) {
      var cell = heatCell(ev);
      if (!cell) return;
      var b = D.heat.step_bins[cell.r];
      selectStep((b[0] + b[1]) / 2);
    });
    var t = null;
    window.addEventListener("resize", function () { clearTimeout(t); t = setTimeout(renderAll, 120); });
  }

  // ------------------------------------------------------------------ SVG charts
  var CW = 560, CH = 250, PAD = { l: 52, r: 12, t: 14, b: 34 };
  function svgRoot(container, h) {
    clear(container);
    return sv("svg", { viewBox: "0 0 " + CW + " " + (h || CH), preserveAspectRatio: "xMidYMid meet", role: "img" }, container);
  }
  function emptyMsg(container, text) { clear(container); el("div", { "class": "empty" }, container, text); }
  function swatches(container, items) {
    var d = el("div", { "class": "swatches" }, container);
    items.forEach(function (it) {
      var s = el("span", { "class": "swatch" }, d);
      var i = el("i", { "class": it.kind || "" }, s);
      if (it.kind === "dash") i.style.borderColor = it.color; else i.style.background = it.color;
      s.appendChild(document.createTextNode(it.label));
    });
    return d;
  }
  function yAxis(g, y0, y1, lo, hi, fmt, label) {
    var ticks = niceTicks(lo, hi, 5);
    var grid = sv("g", { "class": "grid" }, g), ax = sv("g", { "class": "axis" }, g);
    ticks.forEach(function (t) {
      var y = y0 - (t - lo) / (hi - lo) * (y0 - y1);
      if (y < y1 - 0.5) return;
      sv("line", { x1: PAD.l, x2: CW - PAD.r, y1: y, y2: y }, grid);
      sv("text", { x: PAD.l - 6, y: y + 3.5, "text-anchor": "end" }, ax, (fmt || tickLabel)(t));
    });
    sv("line", { x1: PAD.l, x2: PAD.l, y1: y1, y2: y0 }, ax);
    if (label) sv("text", { x: 12, y: (y0 + y1) / 2, transform: "rotate(-90 12 " + (y0 + y1) / 2 + ")", "text-anchor": "middle", "class": "title" }, ax, label);
    return ticks;
  }

  function logAxis(g, y0, y1, lo, hi, fmt, label) {  // lo, hi: log10 of the range
    var grid = sv("g", { "class": "grid" }, g), ax = sv("g", { "class": "axis" }, g);
    var mult = hi - lo > 3 ? [1] : [1, 2, 5];
    for (var k = Math.floor(lo); k <= Math.ceil(hi); k++) mult.forEach(function (m) {
      var v = m * Math.pow(10, k), t = Math.log10(v);
      if (t < lo || t > hi) return;
      var y = y0 - (t - lo) / (hi - lo) * (y0 - y1);
      sv("line", { x1: PAD.l, x2: CW - PAD.r, y1: y, y2: y }, grid);
      sv("text", { x: PAD.l - 6, y: y + 3.5, "text-anchor": "end" }, ax, (fmt || tickLabel)(v));
    });
    sv("line", { x1: PAD.l, x2: PAD.l, y1: y1, y2: y0 }, ax);
    sv("text", { x: 12, y: (y0 + y1) / 2, transform: "rotate(-90 12 " + (y0 + y1) / 2 + ")", "text-anchor": "middle", "class": "title" }, ax, label);
  }

  function barChart(container, opts) {
    // opts: series [{name, values, color}], labels (x), bound {value,label}, meanLine, ylabel, tip(i, s)
    var svg = svgRoot(container), n = opts.series[0].values.length, ns = opts.series.length;
    var y0 = CH - PAD.b, y1 = PAD.t, x0 = PAD.l, x1 = CW - PAD.r;
    var hi = 0;
    opts.series.forEach(function (s) { hi = Math.max(hi, maxOf(s.values)); });
    if (opts.bound) hi = Math.max(hi, opts.bound.value);
    if (!(hi > 0)) hi = 1;
    hi *= 1.08;
    yAxis(svg, y0, y1, 0, hi, opts.fmt, opts.ylabel);
    var gw = (x1 - x0) / n, bw = Math.max(1, gw * 0.84 / ns);
    if (opts.nodeOf) {  // node boundaries
      for (var r = 1; r < n; r++) if (opts.nodeOf[r] !== opts.nodeOf[r - 1])
        sv("line", { x1: x0 + r * gw, x2: x0 + r * gw, y1: y1, y2: y0, stroke: "#9fb3c8", "stroke-dasharray": "3 3" }, svg);
    }
    opts.series.forEach(function (s, k) {
      var g = sv("g", { "class": "bars", "data-series": s.name }, svg);
      s.values.forEach(function (v, i) {
        var h = v === null ? 0 : v / hi * (y0 - y1);
        sv("rect", { x: x0 + i * gw + gw * 0.08 + k * bw, y: y0 - h, width: bw, height: Math.max(h, v > 0 ? 0.5 : 0),
          fill: s.colors ? s.colors[i] : s.color, "data-rank": i, "data-value": v === null ? "" : v,
          "data-tip": opts.tip(i, s, v) }, g);
      });
    });
    if (opts.meanLine !== undefined && opts.meanLine !== null) {
      var ym = y0 - opts.meanLine / hi * (y0 - y1);
      sv("line", { x1: x0, x2: x1, y1: ym, y2: ym, stroke: "#52606d", "stroke-dasharray": "2 3", "stroke-width": 1,
        "data-tip": "mean " + fmtNum(opts.meanLine, 1), "class": "mean-line", "data-value": opts.meanLine }, svg);
    }
    if (opts.bound) {
      var yb = y0 - opts.bound.value / hi * (y0 - y1);
      sv("line", { x1: x0, x2: x1, y1: yb, y2: yb, stroke: "var(--bound)", "stroke-width": 2, "stroke-dasharray": "6 4",
        "class": "bound-line", "data-value": opts.bound.value, "data-tip": opts.bound.label }, svg);
    }
    var every = Math.max(1, Math.ceil(n / Math.floor((x1 - x0) / 22)));
    var ax = sv("g", { "class": "axis" }, svg);
    sv("line", { x1: x0, x2: x1, y1: y0, y2: y0 }, ax);
    for (var i = 0; i < n; i += every) sv("text", { x: x0 + (i + 0.5) * gw, y: y0 + 13, "text-anchor": "middle" }, ax, String(opts.labels ? opts.labels[i] : i));
    sv("text", { x: (x0 + x1) / 2, y: y0 + 28, "text-anchor": "middle", "class": "title" }, ax, opts.xlabel || "rank");
    return svg;
  }

  function lineChart(container, opts) {
    // opts: x [..], series [{name, values, color, dash, width}], points [{x, y, color, tip}], marker x, ylabel, fmt
    var svg = svgRoot(container), xs = opts.x;
    var y0 = CH - PAD.b, y1 = PAD.t, x0 = PAD.l, x1 = CW - PAD.r;
    var lo = Infinity, hi = -Infinity, xlo = Infinity, xhi = -Infinity;
    xs.forEach(function (x) { if (x !== null) { xlo = Math.min(xlo, x); xhi = Math.max(xhi, x); } });
    opts.series.forEach(function (s) { (s.values || []).forEach(function (v) { if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); } }); });
    (opts.points || []).forEach(function (p) { if (p.y !== null) { lo = Math.min(lo, p.y); hi = Math.max(hi, p.y); } });
    // a log axis when positive values span more than 50x (measured host times next to predicted GPU ones)
    var pos = [];
    opts.series.forEach(function (s) { (s.values || []).forEach(function (v) { if (v !== null && v > 0) pos.push(v); }); });
    var logScale = opts.allowLog && pos.length > 1 && Math.max.apply(null, pos) / Math.min.apply(null, pos) > 50;
    var Y;
    if (logScale) {
      lo = Math.log10(Math.min.apply(null, pos)) - 0.1; hi = Math.log10(Math.max.apply(null, pos)) + 0.1;
      Y = function (y) { return y0 - (Math.log10(Math.max(y, Math.pow(10, lo))) - lo) / (hi - lo) * (y0 - y1); };
      logAxis(svg, y0, y1, lo, hi, opts.fmt, opts.ylabel + " (log)");
    } else {
      if (opts.floor !== undefined) lo = Math.min(lo, opts.floor);
      if (!isFinite(lo)) { lo = 0; hi = 1; }
      if (hi - lo < 1e-9) { hi = lo + (Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1); }
      var pad = (hi - lo) * 0.08; hi += pad; if (opts.floor === undefined) lo -= pad;
      Y = function (y) { return y0 - (y - lo) / (hi - lo) * (y0 - y1); };
      yAxis(svg, y0, y1, lo, hi, opts.fmt, opts.ylabel);
    }
    svg.setAttribute("data-scale", logScale ? "log" : "linear");
    if (xhi === xlo) { xlo -= 0.5; xhi += 0.5; }
    var X = function (x) { return x0 + (x - xlo) / (xhi - xlo) * (x1 - x0); };
    var ax = sv("g", { "class": "axis" }, svg);
    sv("line", { x1: x0, x2: x1, y1: y0, y2: y0 }, ax);
    niceTicks(xlo, xhi, 6).forEach(function (t) {
      if (t < xlo || t > xhi) return;
      sv("text", { x: X(t), y: y0 + 13, "text-anchor": "middle" }, ax, tickLabel(t));
    });
    sv("text", { x: (x0 + x1) / 2, y: y0 + 28, "text-anchor": "middle", "class": "title" }, ax, "step");
    if (opts.marker !== undefined && opts.marker !== null)
      sv("line", { x1: X(opts.marker), x2: X(opts.marker), y1: y1, y2: y0, stroke: "#dc2626", "stroke-width": 1, "stroke-dasharray": "3 3", "class": "step-marker" }, svg);
    opts.series.forEach(function (s) {
      if (!s.values) return;
      var d = "", pen = false, cnt = 0;
      s.values.forEach(function (v, i) {
        if (v === null || xs[i] === null) { pen = false; return; }
        d += (pen ? "L" : "M") + X(xs[i]).toFixed(1) + " " + Y(v).toFixed(1);
        pen = true; cnt++;
      });
      var g = sv("g", { "class": "series", "data-series": s.name }, svg);
      if (d) sv("path", { d: d, fill: "none", stroke: s.color, "stroke-width": s.width || 1.8, "stroke-dasharray": s.dash || null, "stroke-linejoin": "round" }, g);
      if (cnt <= 60) s.values.forEach(function (v, i) {  // dots carry the numbers when few
        if (v === null || xs[i] === null) return;
        sv("circle", { cx: X(xs[i]), cy: Y(v), r: 2.6, fill: s.color, "data-value": v, "data-tip": s.name + " at step " + fmtNum(xs[i], 1) + ": " + (opts.fmtTip || fmtNum)(v) }, g);
      });
    });
    (opts.points || []).forEach(function (p) {
      sv("circle", { cx: X(p.x), cy: Y(p.y), r: 4, fill: "#fff", stroke: p.color, "stroke-width": 2, "data-value": p.y, "data-tip": p.tip, "class": "sample-point" }, svg);
    });
    // hover anywhere: nearest x
    var hover = sv("rect", { x: x0, y: y1, width: x1 - x0, height: y0 - y1, fill: "transparent" }, svg);
    hover.addEventListener("mousemove", function (ev) {
      var pt = svg.createSVGPoint(); pt.x = ev.clientX; pt.y = ev.clientY;
      var p = pt.matrixTransform(svg.getScreenCTM().inverse()), best = -1, d = Infinity;
      xs.forEach(function (x, i) { if (x !== null && Math.abs(X(x) - p.x) < d) { d = Math.abs(X(x) - p.x); best = i; } });
      if (best < 0) return;
      var lines = ["step " + fmtNum(xs[best], 1)];
      opts.series.forEach(function (s) { if (s.values && s.values[best] !== null) lines.push(s.name + ": " + (opts.fmtTip || fmtNum)(s.values[best])); });
      showTip(lines.join("\n"), ev.clientX, ev.clientY);
    });
    hover.addEventListener("mouseleave", hideTip);
    hover.parentNode.insertBefore(hover, hover.parentNode.firstChild.nextSibling);
    return svg;
  }

  // ------------------------------------------------------------------ detail panels
  function renderStepLabel() {
    var list = samples(), r = $("step-range"), s = sample();
    r.max = Math.max(0, list.length - 1);
    r.value = Math.min(state.sample, list.length - 1);
    r.disabled = list.length <= 1;
    $("step-label").textContent = s ? "step " + s.step + (M.microbatches > 1 ? ", micro-batch " + s.mb : "") + " · sample " + (state.sample + 1) + " of " + list.length : "no records";
    $("step-range").setAttribute("data-step", s ? s.step : "");
  }
  function renderRankLoad() {
    var c = $("rankload"), s = sample(), cap = $("rankload-caption");
    if (!s || !s.before) { emptyMsg(c, "No load recorded for this record."); cap.textContent = ""; return; }
    var series = [{ name: "before", values: s.before, color: "var(--before)" }];
    if (s.after) series.push({ name: "after", values: s.after, color: "var(--after)" });
    var m = mean(s.before);
    clear(c);
    barChart(c, { series: series, meanLine: m, ylabel: "tokens", nodeOf: M.node_of,
      tip: function (i, se, v) { return "rank " + i + " (" + se.name + " balancing): " + fmtNum(v, 1) + " tokens" + (m > 0 ? "\n" + (v / m).toFixed(3) + " × mean" : ""); } });
    swatches(c, [{ label: "before (home experts only)", color: "var(--before)" }].concat(s.after ? [{ label: "after (" + s.plan_source + " plan)", color: "var(--after)" }] : []).concat([{ label: "mean", color: "#52606d", kind: "dash" }]));
    cap.innerHTML = "";
    cap.appendChild(document.createTextNode("max:mean "));
    el("b", { id: "imb-before" }, cap, fmtRatio(s.imb_before));
    if (s.after) { cap.appendChild(document.createTextNode(" → ")); el("b", { id: "imb-after" }, cap, fmtRatio(s.imb_after)); }
    cap.appendChild(document.createTextNode(" · busiest rank " + fmtNum(maxOf(s.before), 1) + (s.after ? " → " + fmtNum(maxOf(s.after), 1) : "") + " tokens"));
  }
  function replicaCounts(s) {
    var cnt = {};
    if (!s || !s.slot_src) return cnt;
    s.slot_src.forEach(function (row) { row.forEach(function (e) { if (e >= 0) cnt[e] = (cnt[e] || 0) + 1; }); });
    return cnt;
  }
  function renderExpertSelect() {
    var s = sample(), sel = clear($("expert-select")), cnt = replicaCounts(s);
    var ex = Object.keys(cnt).map(Number).sort(function (a, b) { return cnt[b] - cnt[a] || a - b; });
    if (!ex.length) { el("option", { value: -1 }, sel, "no replicas"); state.expert = null; sel.disabled = true; return; }
    sel.disabled = false;
    ex.forEach(function (e) { el("option", { value: e }, sel, "expert " + e + " (" + cnt[e] + " replica" + (cnt[e] > 1 ? "s" : "") + ")"); });
    if (state.expert === null || !(state.expert in cnt)) state.expert = ex[0];
    sel.value = String(state.expert);
  }
  function renderPlacement() {
    var c = $("placement"), s = sample(), cap = $("placement-caption");
    if (!s || !s.slot_src) { emptyMsg(c, "No plan for this record" + (M.planner ? "." : " (the trace holds no plans; the viewer plans imported loads with --planner).")); cap.textContent = ""; return; }
    var S = s.slot_src[0].length, cnt = replicaCounts(s), filled = 0;
    var depth = s.mc ? s.mc.depth : null;
    // ranks wrap into rows of at most 16, each rank a column of its S slots
    var perRow = W <= 16 ? W : 16, nRows = Math.ceil(W / perRow);
    var x0 = PAD.l, cell = Math.min(48, (CW - PAD.l - PAD.r) / perRow), blockH = S * cell + 18;
    var h = PAD.t + nRows * blockH + 24;
    var svg = svgRoot(c, h);
    var g = sv("g", { "class": "cells" }, svg), ax = sv("g", { "class": "axis" }, svg);
    for (var br = 0; br < nRows; br++) for (var k = 0; k < S; k++)
      sv("text", { x: x0 - 6, y: PAD.t + br * blockH + (k + 0.62) * cell, "text-anchor": "end" }, ax, "slot " + k);
    for (var r = 0; r < W; r++) {
      var bx = x0 + (r % perRow) * cell, by = PAD.t + Math.floor(r / perRow) * blockH;
      sv("text", { x: bx + cell / 2, y: by + S * cell + 12, "text-anchor": "middle" }, ax, String(r));
      for (var k2 = 0; k2 < S; k2++) {
        var e = s.slot_src[r][k2], x = bx, y = by + k2 * cell;
        var grp = sv("g", { "class": "cell", "data-rank": r, "data-slot": k2, "data-expert": e }, g);
        var tipText = e < 0 ? "rank " + r + " slot " + k2 + ": empty" :
          "rank " + r + " slot " + k2 + ": expert " + e + " (home rank " + homeOf(e) + ", " + cnt[e] + " replica" + (cnt[e] > 1 ? "s" : "") + ")" +
          (depth ? "\nmulticast tree depth " + depth[r][k2] + (s.mc.parent_slot[r][k2] < 0 ? ", fed by its home" : ", fed by rank " + s.mc.parent_rank[r][k2] + " (relay)") : "");
        sv("rect", { x: x + 1, y: y + 1, width: cell - 2, height: cell - 2, rx: 3,
          fill: e < 0 ? "#eef2f6" : rankColor(homeOf(e)), "class": e >= 0 && e === state.expert ? "hot" : null, "data-tip": tipText }, grp);
        if (e >= 0) filled++;
        if (cell >= 16 && e >= 0) sv("text", { x: x + cell / 2, y: y + cell * 0.62, "text-anchor": "middle" }, grp, String(e));
        if (e >= 0) grp.addEventListener("click", (function (ee) { return function () { state.expert = ee; $("expert-select").value = String(ee); renderPlacement(); renderTree(); }; })(e));
      }
    }
    sv("text", { x: x0 + perRow * cell / 2, y: h - 6, "text-anchor": "middle", "class": "title" }, ax, "rank (colour: the expert's home rank; click a cell to show its tree)");
    cap.innerHTML = "";
    el("b", null, cap, String(filled));
    cap.appendChild(document.createTextNode(" of " + W * S + " slots filled · " + Object.keys(cnt).length + " experts replicated · plan: " + s.plan_source));
    c.setAttribute("data-filled", filled);
  }
  function renderTree() {
    var c = $("tree"), s = sample(), cap = $("tree-caption"), st = s ? s[state.op] : null;
    if (!s || !s.slot_src || state.expert === null) { emptyMsg(c, s && s.slot_src ? "This plan replicates no expert." : "No plan for this record."); cap.textContent = ""; return; }
    if (!st) { emptyMsg(c, "No schedule recorded for this plan (record it with a schedule, or from a Context)."); cap.textContent = ""; return; }
    var e = state.expert, home = homeOf(e), S = s.slot_src[0].length;
    var nodes = [{ id: "m", rank: home, slot: -1, depth: 0, parent: null }], byId = { m: nodes[0] };
    for (var r = 0; r < W; r++) for (var k = 0; k < S; k++) if (s.slot_src[r][k] === e) {
      var n = { id: r + ":" + k, rank: r, slot: k, depth: st.depth[r][k], pr: st.parent_rank[r][k], ps: st.parent_slot[r][k] };
      nodes.push(n); byId[n.id] = n;
    }
    nodes.forEach(function (n) { if (n.id !== "m") n.parent = n.ps < 0 ? byId.m : byId[n.pr + ":" + n.ps] || byId.m; });
    var maxD = 0; nodes.forEach(function (n) { maxD = Math.max(maxD, n.depth); });
    var levels = []; for (var d = 0; d <= maxD; d++) levels.push([]);
    nodes.forEach(function (n) { levels[n.depth].push(n); });
    var gap = 64, h = Math.max(150, 40 + maxD * gap + 50), svg = svgRoot(c, h);
    var x0 = 20, x1 = CW - 20;
    levels.forEach(function (lv, d) {
      lv.sort(function (a, b) { return (d ? (a.parent.x - b.parent.x) : 0) || a.rank - b.rank || a.slot - b.slot; });
      var w = (x1 - x0) / Math.max(1, lv.length);
      lv.forEach(function (n, i) { n.x = x0 + (i + 0.5) * w; n.y = 30 + d * gap; n.w = w; });
    });
    var defs = sv("defs", null, svg);
    var mk = sv("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
    sv("path", { d: "M0 0L10 5L0 10z", fill: "#7b8794" }, mk);
    var rad = Math.max(5, Math.min(15, (x1 - x0) / Math.max(1, maxLevel(levels)) / 2 - 2));
    var eg = sv("g", { "class": "edges" }, svg);
    nodes.forEach(function (n) {
      if (!n.parent) return;
      var a = n.parent, b = n, dx = b.x - a.x, dy = b.y - a.y, L = Math.sqrt(dx * dx + dy * dy) || 1;
      var ra = a.id === "m" ? 13 : rad, sx = a.x + dx / L * ra, sy = a.y + dy / L * ra, ex = b.x - dx / L * (rad + 1), ey = b.y - dy / L * (rad + 1);
      var up = state.op === "rd";
      var internode = M.node_of[a.rank] !== M.node_of[b.rank];
      sv("line", { x1: up ? ex : sx, y1: up ? ey : sy, x2: up ? sx : ex, y2: up ? sy : ey, stroke: internode ? "#dc2626" : "#7b8794",
        "stroke-width": 1.6, "marker-end": "url(#arrow)", "class": "edge", "data-from": up ? b.rank : a.rank, "data-to": up ? a.rank : b.rank,
        "data-tip": (up ? "rank " + b.rank + " → rank " + a.rank + " (partial gradient sum)" : "rank " + a.rank + " → rank " + b.rank + " (weights, chunk-streamed)") + (internode ? "\ncrosses nodes (RDMA)" : "") }, eg);
    });
    var ng = sv("g", { "class": "nodes" }, svg);
    nodes.forEach(function (n) {
      var g = sv("g", { "class": "node" + (n.id === "m" ? " master" : ""), "data-rank": n.rank, "data-depth": n.depth,
        "data-tip": n.id === "m" ? "home rank " + n.rank + ": master copy of expert " + e :
          "rank " + n.rank + ", slot " + n.slot + " · depth " + n.depth + "\nfed by " + (n.parent.id === "m" ? "its home (rank " + home + ")" : "rank " + n.parent.rank + " (relay)") +
          "\nforwards to " + nodes.filter(function (m) { return m.parent === n; }).length + " rank(s)" }, ng);
      if (n.id === "m") {
        sv("rect", { x: n.x - 26, y: n.y - 13, width: 52, height: 26, rx: 6, fill: "#102a43" }, g);
        sv("text", { x: n.x, y: n.y + 3.5, "text-anchor": "middle" }, g, "home " + n.rank);
      } else {
        sv("circle", { cx: n.x, cy: n.y, r: rad, fill: rankColor(n.rank, 45), stroke: "#fff", "stroke-width": 1.5 }, g);
        if (rad >= 9) sv("text", { x: n.x, y: n.y + 3.5, "text-anchor": "middle" }, g, String(n.rank));
      }
    });
    for (var dd = 1; dd <= maxD; dd++) sv("text", { x: 4, y: 30 + dd * gap + 3.5, "class": "title" }, svg, "d" + dd);
    var relays = nodes.filter(function (n) { return n.id !== "m" && nodes.some(function (m) { return m.parent === n; }); }).length;
    cap.innerHTML = "";
    cap.appendChild(document.createTextNode("expert "));
    el("b", null, cap, String(e));
    cap.appendChild(document.createTextNode(" · " + (nodes.length - 1) + " replicas, depth " + maxD + ", " + relays + " relay" + (relays === 1 ? "" : "s") +
      " · " + (state.op === "mc" ? "weight_sync: weights flow down" : "grad_reduce: partial sums flow up")));
    c.setAttribute("data-replicas", nodes.length - 1);
    c.setAttribute("data-depth", maxD);
  }
  function maxLevel(levels) { var m = 1; levels.forEach(function (l) { m = Math.max(m, l.length); }); return m; }
  function renderEgress() {
    var c = $("egress"), s = sample(), cap = $("egress-caption"), st = s ? s[state.op] : null;
    if (!st) { emptyMsg(c, "No schedule stats for this record."); cap.textContent = ""; return; }
    var mc = state.op === "mc", what = mc ? "egress" : "ingress";
    var vals = (mc ? st.egress : st.ingress).map(function (v) { return v * st.unit; });
    var mx = Math.max.apply(null, vals), lb = st.lower_bound_bytes;
    clear(c);
    barChart(c, { series: [{ name: what, values: vals, colors: vals.map(function (v) { return v === mx && v > 0 ? "#1d4ed8" : "#93c5fd"; }) }],
      bound: { value: lb, label: "lower bound: " + fmtBytes(lb) + " on the busiest link (DESIGN.md)" }, fmt: tickLabel, ylabel: "bytes", nodeOf: M.node_of,
      tip: function (i, se, v) { return "rank " + i + " " + what + ": " + fmtBytes(v) + (lb > 0 ? " (" + (v / lb).toFixed(2) + " × lower bound)" : ""); } });
    swatches(c, [{ label: what + " per rank (" + (mc ? "weights sent" : "gradients pulled") + ")", color: "#93c5fd" }, { label: "busiest", color: "#1d4ed8" }, { label: "lower bound", color: "var(--bound)", kind: "dash" }]);
    cap.innerHTML = "";
    cap.appendChild(document.createTextNode("max " + what + " "));
    el("b", { id: "egress-max" }, cap, fmtBytes(mx));
    cap.appendChild(document.createTextNode(" vs lower bound "));
    el("b", { id: "egress-lb" }, cap, fmtBytes(lb));
    cap.appendChild(document.createTextNode((lb > 0 ? " (×" + (mx / lb).toFixed(2) + ")" : "") + " · predicted " + fmtMs(st.predicted_s * 1e3) + ", bound " + fmtMs(st.lower_bound_s * 1e3) + " (cost model)"));
  }

  // ------------------------------------------------------------------ series panels
  function renderSeries() {
    var ser = D.series.layers[String(state.layer)], xs = D.series.x, s = sample(), marker = s ? s.step : null;
    var ci = $("imbalance"), capI = $("imbalance-caption");
    var pts = [];
    var afterSeries = ser && ser.imb_after;
    if (!afterSeries) samples().forEach(function (p) { if (p.imb_after !== null && p.plan_source) pts.push({ x: p.step, y: p.imb_after, color: "var(--after)", tip: "step " + p.step + " after (" + p.plan_source + " plan): " + fmtRatio(p.imb_after) }); });
    if (!ser || !ser.imb_before) emptyMsg(ci, "No loads recorded for this layer.");
    else {
      clear(ci);
      lineChart(ci, { x: xs, marker: marker, floor: 1, ylabel: "max : mean", fmt: function (v) { return v.toFixed(2); }, fmtTip: fmtRatio,
        series: [{ name: "before", values: ser.imb_before, color: "#7b8794" }, { name: "after", values: ser.imb_after, color: "var(--after)" }], points: pts });
      swatches(ci, [{ label: "before balancing", color: "#7b8794", kind: "line" }, { label: afterSeries ? "after (recorded plans)" : "after (sampled steps, planned here)", color: "var(--after)", kind: "line" }]);
    }
    capI.textContent = "max:mean rank load per step" + (D.series.x.length < M.steps ? " (mean over " + (M.steps / D.series.x.length).toFixed(1) + " steps per point)" : "");
    var ct = $("times"), capT = $("times-caption");
    var defs = [["t_weight_sync", "weight_sync (measured)", "var(--ws)", null], ["t_restore", "restore (measured)", "var(--restore)", null],
      ["t_grad_reduce", "grad_reduce (measured)", "var(--gr)", null], ["pred_ws", "weight_sync (predicted)", "var(--ws)", "5 4"],
      ["pred_gr", "grad_reduce (predicted)", "var(--gr)", "5 4"], ["lb_ws", "weight_sync lower bound", "#9aa5b1", "2 3"]];
    var series = [];
    defs.forEach(function (d) { if (ser && ser[d[0]]) series.push({ name: d[1], values: ser[d[0]], color: d[2], dash: d[3], width: d[3] ? 1.4 : 1.8 }); });
    if (!series.length) { emptyMsg(ct, "No op times in this trace: record them with Context(..., profile=...) or ULTRACOMM_PROFILE."); capT.textContent = ""; return; }
    clear(ct);
    lineChart(ct, { x: xs, marker: marker, floor: 0, ylabel: "ms", allowLog: true, fmt: function (v) { return tickLabel(v); }, fmtTip: fmtMs, series: series });
    swatches(ct, series.map(function (s) { return { label: s.name, color: s.color, kind: s.dash ? "dash" : "line" }; }));
    capT.textContent = "per op, this layer; measured = host wall time of the transport's run on the recording rank";
  }

  function renderDetail() {
    renderStepLabel();
    renderRankLoad();
    renderExpertSelect();
    renderPlacement();
    renderTree();
    renderEgress();
  }
  function renderAll() { renderHeat(); renderDetail(); renderSeries(); }

  // ------------------------------------------------------------------ start
  function start(payload) {
    D = payload;
    M = D.meta;
    W = M.world; E = M.num_experts; EPR = M.experts_per_rank;
    state = { layer: M.layers[0], sample: 0, expert: null, op: "mc" };
    initSummary();
    initControls();
    initHeatEvents();
    state.sample = worstSample(samples());
    $("layer-select").value = String(state.layer);
    renderAll();
    document.body.setAttribute("data-ready", "1");
  }
  inflatePayload().then(start).catch(function (err) {
    var main = document.querySelector("main");
    clear(main);
    el("div", { "class": "card wide empty", id: "load-error" }, main, "Could not read this report's data: " + err.message);
    document.body.setAttribute("data-ready", "error");
    throw err;
  });
})();
