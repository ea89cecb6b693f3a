"""HTML viewer of a load trace: one self-contained file that works offline.

    python -m ultracomm.viewer TRACE -o report.html [--planner auto|recorded|none|quota|...]

Panels: expert load over steps x experts per layer (heatmap, canvas), per-rank load before
and after balancing, replica placement, the relay tree of a chosen expert (nodes = ranks,
edges = sends, depth), per-rank egress (ingress for grad_reduce) against the lower bound,
imbalance and op times over steps.  Pick layer, step, expert and operation; hover for numbers;
click a heatmap row or a placement cell to select.

The page is ``assets/viewer.html`` with ``viewer.css``, ``viewer.js`` and the data
(:func:`ultracomm.viewer.payload.build_payload`, bounded in size for large traces) inlined:
no CDN, no network, no library.
"""

from __future__ import annotations

import base64
import json
import os
import re
import zlib
from importlib import resources
from typing import Any, Union

from ..profile import Trace
from .payload import build_payload, default_domain

__all__ = ["render_html", "write_html", "build_payload", "default_domain"]


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def render_html(trace_or_payload: Union[Trace, dict], **options: Any) -> str:
    """The page as a string, from a :class:`~ultracomm.profile.Trace` (``options`` go to
    :func:`build_payload`) or from a payload it built."""
    payload = trace_or_payload if isinstance(trace_or_payload, dict) else build_payload(trace_or_payload, **options)
    # deflate + base64 (the page inflates it with DecompressionStream): JSON of a large trace
    # shrinks 5-10x, and base64 holds no "</" that could end the <script> element
    raw = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    data = base64.b64encode(zlib.compress(raw, 9)).decode("ascii")
    title = (payload.get("title") or "ultracomm load profile").replace("&", "&amp;").replace("<", "&lt;")
    parts = {
        "/*{{CSS}}*/": _asset("viewer.css"),
        "/*{{JS}}*/": _asset("viewer.js"),
        "{{TITLE}}": title,
        "{{DATA}}": data,
    }
    # one pass: text put in is never searched for the next placeholder
    return re.sub("|".join(re.escape(k) for k in parts), lambda m: parts[m.group(0)], _asset("viewer.html"))


def write_html(trace: Trace, out: Union[str, os.PathLike], **options: Any) -> int:
    """Write :func:`render_html` of ``trace`` to ``out``; returns its size in bytes."""
    page = render_html(trace, **options)
    data = page.encode("utf-8")
    with open(out, "wb") as f:
        f.write(data)
    return len(data)
