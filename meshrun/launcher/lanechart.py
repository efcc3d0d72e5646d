"""A lane chart as plain SVG: time on x, one lane per row, bands, bars and marks; stdlib only.

The one picture both ``meshrun timeline`` (a job's nodes and ranks over its rounds) and the
pipeline schedules (`meshrun.launcher.timeline.schedule_svg`: stages over one step) are drawn
as. `render` takes data and returns one ``<svg>`` element as text, valid XML, with no script
and no external style: every colour is an attribute, every bar and mark has a ``<title>``
(the tooltip a browser shows on hover) and a ``class`` naming what it is (``lane``, ``band``,
``bar <style>``, ``mark <kind>``), and ``data-lane`` / ``data-t`` (``data-start``,
``data-end``) attributes with its lane index and times (from ``t0``), so the picture can be
read back by a program too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

SVG_NS = "http://www.w3.org/2000/svg"

# fill colours of bars by style, and of marks by kind (also the legend's)
BAR_COLOURS = {
    "ok": "#7fb77e", "failed": "#e06666", "stopped": "#b7b7b7", "running": "#9fc5e8",
    "agent": "#d9d2e9", "F": "#6fa8dc", "B": "#93c47d", "W": "#f6b26b",
}  # fmt: skip
MARK_COLOURS = {
    "failure": "#cc0000", "hang": "#e69138", "node_lost": "#674ea7", "join": "#38761d",
    "restart": "#1155cc", "straggler": "#bf9000", "agent_exit": "#000000",
}  # fmt: skip
_BAND_FILLS = ("#f3f6fb", "#fbf8ef")

_LEFT, _RIGHT, _TOP, _LANE, _AXIS, _LEGEND = 190, 20, 30, 20, 26, 20


@dataclass(frozen=True)
class Lane:
    """One row. ``header`` rows (a node) are drawn bold, with a rule above them."""

    label: str
    header: bool = False


@dataclass(frozen=True)
class Band:
    """A shaded span of time across every lane (a round), labelled at the top."""

    start: float
    end: float
    label: str
    title: str = ""


@dataclass(frozen=True)
class Bar:
    """A span of time on one lane (a worker's life, a pipeline action); ``style`` picks the
    colour (`BAR_COLOURS`); ``label`` is drawn inside when it fits."""

    lane: int
    start: float
    end: float
    style: str
    label: str = ""
    title: str = ""


@dataclass(frozen=True)
class Mark:
    """A moment on one lane (a failure, a restart, ...); ``kind`` picks shape and colour."""

    lane: int
    t: float
    kind: str
    title: str = ""


def render(
    lanes: Sequence[Lane],
    bars: Sequence[Bar] = (),
    marks: Sequence[Mark] = (),
    bands: Sequence[Band] = (),
    *,
    title: str = "",
    legend: Sequence[tuple[str, str, str]] = (),
    t0: float | None = None,
    t1: float | None = None,
    unit: str = "s",
    width: int = 1200,
) -> str:
    """The chart as one ``<svg>`` element (text).

    Args:
        lanes: the rows, top to bottom; bars and marks name them by index.
        bars, marks, bands: what to draw (times in the same unit as ``t0``/``t1``).
        title: a line above the chart.
        legend: ``(what, key, label)`` entries, ``what`` being ``"bar"`` (key a bar style) or
            ``"mark"`` (key a mark kind).
        t0, t1: the time range shown (default: everything drawn); the axis is labelled in
            ``unit`` from ``t0``.
        width: pixels.
    """
    times = [b.start for b in bars] + [b.end for b in bars] + [m.t for m in marks]
    times += [b.start for b in bands] + [b.end for b in bands]
    t0 = min(times, default=0.0) if t0 is None else t0
    t1 = max(times, default=1.0) if t1 is None else t1
    span = t1 - t0 if t1 > t0 else 1.0
    plot_w = width - _LEFT - _RIGHT
    height = _TOP + _LANE * len(lanes) + _AXIS + _LEGEND * (1 if legend else 0) + 8
    bottom = _TOP + _LANE * len(lanes)

    def x(t: float) -> float:
        return round(_LEFT + (t - t0) / span * plot_w, 2)

    out = [
        f'<svg xmlns="{SVG_NS}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(title or 'timeline')}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    if title:
        out.append(f'<text x="8" y="16" font-size="13" font-weight="bold">{escape(title)}</text>')
    for i, band in enumerate(bands):
        bx, bw = x(band.start), max(1.0, x(band.end) - x(band.start))
        out.append(
            f'<g class="band" data-start="{_fmt(band.start - t0)}" data-end="{_fmt(band.end - t0)}">'
            f"<title>{escape(band.title or band.label)}</title>"
            f'<rect x="{bx}" y="{_TOP - 10}" width="{round(bw, 2)}" height="{bottom - _TOP + 10}" '
            f'fill="{_BAND_FILLS[i % 2]}" stroke="#c9d3e3" stroke-width="0.5"/>'
            f'<text x="{bx + 3}" y="{_TOP - 1}" fill="#3d5a80">{escape(band.label)}</text></g>'
        )
    for i, lane in enumerate(lanes):
        y = _TOP + _LANE * i
        weight = ' font-weight="bold"' if lane.header else ""
        rule = (
            f'<line x1="0" y1="{y}" x2="{width}" y2="{y}" stroke="#999999" stroke-width="0.7"/>'
            if lane.header and i
            else ""
        )
        out.append(
            f'<g class="lane" data-lane="{i}">{rule}<text x="{8 if lane.header else 20}" y="{y + 14}"{weight}>'
            f"{escape(lane.label)}</text></g>"
        )
    for bar in bars:
        bx = x(bar.start)
        bw = max(1.0, x(bar.end) - bx)
        y = _TOP + _LANE * bar.lane + 3
        fill = BAR_COLOURS.get(bar.style, "#cccccc")
        text = ""
        if bar.label and bw >= 7 * len(bar.label) + 4:
            text = f'<text x="{bx + 3}" y="{y + 11}" font-size="10">{escape(bar.label)}</text>'
        out.append(
            f'<g class="bar {escape(bar.style)}" data-lane="{bar.lane}" '
            f'data-start="{_fmt(bar.start - t0)}" data-end="{_fmt(bar.end - t0)}"><title>{escape(bar.title or bar.label)}</title>'
            f'<rect x="{bx}" y="{y}" width="{round(bw, 2)}" height="{_LANE - 6}" fill="{fill}" '
            f'stroke="#555555" stroke-width="0.4"/>{text}</g>'
        )
    for mark in marks:
        cx, cy = x(mark.t), _TOP + _LANE * mark.lane + _LANE / 2
        colour = MARK_COLOURS.get(mark.kind, "#444444")
        out.append(
            f'<g class={quoteattr("mark " + mark.kind)} data-lane="{mark.lane}" '
            f'data-t="{_fmt(mark.t - t0)}"><title>{escape(mark.title or mark.kind)}</title>'
            f"{_shape(mark.kind, cx, cy, colour)}</g>"
        )
    out.append(_axis(t0, span, x, bottom, width, unit))
    if legend:
        out.append(_legend(legend, bottom + _AXIS + 6))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _shape(kind: str, cx: float, cy: float, colour: str, r: float = 6.0) -> str:
    def pts(*xy: float) -> str:
        return " ".join(
            f"{round(cx + dx, 2)},{round(cy + dy, 2)}"
            for dx, dy in zip(xy[::2], xy[1::2], strict=True)
        )

    if kind == "failure":  # a cross
        return (
            f'<path d="M{cx - r},{cy - r} L{cx + r},{cy + r} M{cx - r},{cy + r} L{cx + r},{cy - r}" '
            f'stroke="{colour}" stroke-width="2.5"/>'
        )
    if kind == "restart":  # a tall bar
        return (
            f'<rect x="{round(cx - 1.5, 2)}" y="{round(cy - r - 2, 2)}" width="3" '
            f'height="{2 * r + 4}" fill="{colour}"/>'
        )
    shape = {
        "hang": pts(0, -r, r, 0, 0, r, -r, 0),
        "node_lost": pts(-r, -r, r, -r, 0, r),
        "join": pts(-r, r, r, r, 0, -r),
        "agent_exit": pts(
            -r * 0.7, -r * 0.7, r * 0.7, -r * 0.7, r * 0.7, r * 0.7, -r * 0.7, r * 0.7
        ),
    }.get(kind)
    if shape is None:  # straggler and anything else: a dot
        return f'<circle cx="{cx}" cy="{cy}" r="{r * 0.8}" fill="{colour}" stroke="#333333"/>'
    return f'<polygon points="{shape}" fill="{colour}" stroke="#333333" stroke-width="0.5"/>'


def _axis(t0: float, span: float, x, bottom: float, width: int, unit: str) -> str:
    step = _nice_step(span / 8)
    parts = [
        f'<g class="axis"><line x1="{_LEFT}" y1="{bottom}" x2="{width - _RIGHT}" y2="{bottom}" '
        f'stroke="#333333"/>'
    ]
    k = 0
    while k * step <= span + 1e-9:
        tx = x(t0 + k * step)
        parts.append(
            f'<line x1="{tx}" y1="{bottom}" x2="{tx}" y2="{bottom + 4}" stroke="#333333"/>'
            f'<text x="{tx}" y="{bottom + 16}" text-anchor="middle">{_fmt(k * step)} {escape(unit)}'
            "</text>"
        )
        k += 1
    parts.append("</g>")
    return "".join(parts)


def _legend(entries: Sequence[tuple[str, str, str]], y: float) -> str:
    parts, lx = ['<g class="legend">'], 8.0
    for what, key, label in entries:
        if what == "bar":
            parts.append(
                f'<rect x="{lx}" y="{y}" width="14" height="10" '
                f'fill="{BAR_COLOURS.get(key, "#cccccc")}" stroke="#555555" stroke-width="0.4"/>'
            )
        else:
            parts.append(_shape(key, lx + 7, y + 5, MARK_COLOURS.get(key, "#444444"), r=5))
        parts.append(f'<text x="{lx + 18}" y="{y + 9}">{escape(label)}</text>')
        lx += 28 + 6.5 * len(label)
    parts.append("</g>")
    return "".join(parts)


def _nice_step(rough: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``rough``."""
    if rough <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(rough))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= rough)


def _fmt(value: float) -> str:
    return f"{value:.6g}"
