"""A small raster plotting layer on Pillow: the report's charts as PNG files, without matplotlib.

Why: importing matplotlib takes about half a second and drawing one of the report's charts 0.1-0.5 s, most of
what `plan` spent besides its search (issue 13 wants the whole command within a second). These charts need only
axis-aligned bars, lines, markers, text and legends, which Pillow (a dependency of most Python imaging, 20 ms to
import) draws in milliseconds. A figure with slanted lines or dots is drawn at ``SMOOTH`` times the asked size and
reduced once at the end, so they come out smooth (bars and text need not: FreeType smooths its glyphs).

Coordinates: a :class:`Figure` is sized in pixels (at 1x); an :class:`Axes` is a pixel box with data limits on
each side (linear, or logarithmic to any base) and maps data to pixels.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from functools import cache

from PIL import Image, ImageDraw, ImageFont

SMOOTH = 2  # supersampling where asked: drawn at twice the size, reduced with a smoothing filter when saved
SMALL, NORMAL, TITLE = 11, 13, 15  # font sizes in pixels (at 1x)
_ASCII = str.maketrans({"—": "-", "–": "-", "×": "x", "≤": "<=", "≥": ">=", "…": "..."})  # the font lacks them


@cache
def font(size: float) -> ImageFont.FreeTypeFont:
    """Pillow's own scalable font at ``size`` pixels (at the drawing scale)."""
    return ImageFont.load_default(size)


def lighter(color: str, alpha: float) -> str:
    """``color`` (#RRGGBB) as drawn with opacity ``alpha`` over white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - alpha * (255 - c)):02X}" for c in rgb)


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values in [lo, hi], about ``count`` of them, a step of 1, 2 or 5 times a power of ten."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"an axis from {lo} to {hi}: a value to plot is not finite")
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    digits = max(0, -math.floor(math.log10(step)))
    ticks = []
    k = first
    while k * step <= hi + 1e-9 * step:
        ticks.append(round(k * step, digits + 1))
        k += 1
    return ticks


def log_ticks(lo: float, hi: float, base: float, subs: tuple[float, ...] = (1.0,)) -> list[float]:
    """``subs`` times each power of ``base``, those in [lo, hi]; where that gives fewer than two in base 10, the
    1-2-5 steps of each decade."""
    powers = [base ** k for k in range(math.floor(math.log(lo, base)), math.ceil(math.log(hi, base)) + 1)]
    ticks = sorted({float(f"{p * m:.12g}") for p in powers for m in subs
                    if lo * (1 - 1e-9) <= p * m <= hi * (1 + 1e-9)})
    if len(ticks) < 2 and base == 10 and subs != (1.0, 2.0, 5.0):
        return log_ticks(lo, hi, base, (1.0, 2.0, 5.0))
    return ticks


def tick_label(value: float) -> str:
    """A tick's text: thousands separated from 10,000 up, else the shortest %g form."""
    if abs(value) >= 1e4 and float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.6g}"


@dataclass
class Figure:
    """A white canvas of ``width`` x ``height`` pixels; :meth:`save` writes it as PNG. ``scale``: drawn that many
    times larger and reduced when saved (SMOOTH for slanted lines and dots; 1 for bars and text alone, 3-4 times
    quicker to draw)."""

    width: int
    height: int
    scale: int = 1
    image: Image.Image = field(init=False)
    draw: ImageDraw.ImageDraw = field(init=False)

    def __post_init__(self) -> None:
        self.image = Image.new("RGB", (round(self.width * self.scale), round(self.height * self.scale)), "white")
        self.draw = ImageDraw.Draw(self.image)

    def text_size(self, text: str, size: float = NORMAL) -> tuple[float, float]:
        """(width, height) of ``text`` in pixels at 1x (lines split at newlines)."""
        lines = text.translate(_ASCII).split("\n")
        boxes = [font(size * self.scale).getbbox(line) for line in lines]
        width = max(right - left for left, _, right, _ in boxes) / self.scale
        last = boxes[-1]
        return width, 1.25 * size * (len(lines) - 1) + (last[3] - last[1]) / self.scale

    def text(self, x: float, y: float, text: str, size: float = NORMAL, color: str = "black", anchor: str = "mm",
             rotate: float = 0.0) -> None:
        """``text`` at pixel (x, y); ``anchor`` as Pillow's (l/m/r then t/m/b, or s for the baseline); ``rotate``
        degrees counter-clockwise about the anchor (rotated text anchors at its right and middle when 'r', else
        its middle)."""
        text = text.translate(_ASCII)
        f = font(size * self.scale)
        lines = text.split("\n")
        step = 1.25 * size * self.scale  # one line's height
        if not rotate:
            if len(lines) == 1:
                self.draw.text((x * self.scale, y * self.scale), text, font=f, fill=color, anchor=anchor)
                return
            block = step * len(lines)
            top = y * self.scale - {"t": 0.0, "m": block / 2}.get(anchor[1], block)
            for i, line in enumerate(lines):
                self.draw.text((x * self.scale, top + i * step), line, font=f, fill=color, anchor=anchor[0] + "t")
            return
        right = max(f.getbbox(line, anchor="lt")[2] for line in lines)
        mask = Image.new("L", (right + 2, round(step * len(lines)) + 2), 0)
        pen = ImageDraw.Draw(mask)
        for i, line in enumerate(lines):  # each line right-aligned when anchored at its end, else centred
            align = {"r": (right, "rt"), "m": (right / 2, "mt")}.get(anchor[0], (0, "lt"))
            pen.text((align[0], i * step), line, font=f, fill=255, anchor=align[1])
        turned = mask.rotate(rotate, expand=True, resample=Image.BICUBIC)
        w, h = turned.size
        px, py = x * self.scale, y * self.scale
        if anchor[0] == "r":  # the text's end at (x, y): the rotated box's top-right corner for positive angles
            box = (round(px - w), round(py)) if rotate > 0 else (round(px - w), round(py - h))
        else:
            box = (round(px - w / 2), round(py - h / 2))
        self.image.paste(color, box, turned)

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: str | None = None, outline: str | None = None,
             width: float = 1.0) -> None:
        """A rectangle between pixel corners (x0, y0) and (x1, y1), any order."""
        xa, xb = sorted((x0 * self.scale, x1 * self.scale))
        ya, yb = sorted((y0 * self.scale, y1 * self.scale))
        self.draw.rectangle((xa, ya, max(xa, xb - 1), max(ya, yb - 1)), fill=fill, outline=outline,
                            width=max(1, round(width * self.scale)) if outline else 0)

    def line(self, points: list[tuple[float, float]], color: str, width: float = 1.5, dash: float = 0.0) -> None:
        """A polyline through pixel ``points``; ``dash`` > 0: dashes (and gaps) that many pixels long. A point that is
        not finite is an error (a dash loop over an endless segment would never end)."""
        if not all(math.isfinite(x) and math.isfinite(y) for x, y in points):
            raise ValueError("a line through a point that is not finite")
        pts = [(x * self.scale, y * self.scale) for x, y in points]
        w = max(1, round(width * self.scale))
        if not dash:
            self.draw.line(pts, fill=color, width=w, joint="curve")
            return
        on = dash * self.scale
        for (xa, ya), (xb, yb) in zip(pts, pts[1:], strict=False):
            length = math.hypot(xb - xa, yb - ya)
            s = 0.0
            while s < length:
                e = min(length, s + on)
                self.draw.line([(xa + (xb - xa) * s / length, ya + (yb - ya) * s / length),
                                (xa + (xb - xa) * e / length, ya + (yb - ya) * e / length)], fill=color, width=w)
                s += 2 * on

    def polygon(self, points: list[tuple[float, float]], fill: str) -> None:
        self.draw.polygon([(x * self.scale, y * self.scale) for x, y in points], fill=fill)

    def star(self, x: float, y: float, radius: float, color: str) -> None:
        """A five-pointed star centred at pixel (x, y)."""
        self.polygon([(x + r * math.sin(k * math.pi / 5), y - r * math.cos(k * math.pi / 5))
                      for k in range(10) for r in [radius if k % 2 == 0 else radius * 0.45]], color)

    def dot(self, x: float, y: float, radius: float, color: str) -> None:
        r = radius * self.scale
        self.draw.ellipse((x * self.scale - r, y * self.scale - r, x * self.scale + r, y * self.scale + r), fill=color)

    def legend(self, entries: list[tuple[str, str, str]], x: float, y: float, columns: int = 1,
               anchor: str = "lt", size: float = SMALL) -> tuple[float, float]:
        """Legend entries (label, colour, 'patch' | 'line' | 'dashed' | 'dot' |
        'star') in ``columns`` columns, its box's
        corner at (x, y) by ``anchor`` ('lt' top-left, 'mt' top-centre, 'rt' top-right); returns its size."""
        key, gap, row = 22, 14, size + 6
        widths = [key + 4 + self.text_size(label, size)[0] for label, _, _ in entries]
        cols = max(1, min(columns, len(entries)))
        col_w = [max(widths[i::cols], default=0) for i in range(cols)]
        total_w = sum(col_w) + gap * (cols - 1)
        total_h = row * math.ceil(len(entries) / cols)
        x0 = x - total_w / 2 if anchor[0] == "m" else x - total_w if anchor[0] == "r" else x
        for i, (label, color, kind) in enumerate(entries):
            cx = x0 + sum(col_w[: i % cols]) + gap * (i % cols)
            cy = y + row * (i // cols) + row / 2
            if kind == "star":
                self.star(cx + key / 2, cy, 7, color)
            elif kind == "patch":
                self.rect(cx, cy - 5, cx + key, cy + 5, fill=color)
            elif kind == "dot":
                self.dot(cx + key / 2, cy, 4, color)
            else:
                self.line([(cx, cy), (cx + key, cy)], color, 2, dash=4 if kind == "dashed" else 0)
            self.text(cx + key + 4, cy, label, size, anchor="lm")
        return total_w, total_h

    def save(self, path: str | io.BytesIO) -> None:
        """Reduce to the asked size (smoothing the supersampled drawing) and write a PNG."""
        image = self.image.resize((self.width, self.height), Image.Resampling.BOX) if self.scale != 1 else self.image
        image.save(path, format="PNG", compress_level=1)


def warm_up() -> None:
    """Draw and encode a small figure once, in memory: a process's first chart pays for Pillow's lazy set-up (its
    PNG plugin and encoder, FreeType's first glyphs at each size), about 10 ms. The chart server runs this while
    the search runs, so that neither it nor the grandchild it forks pays it while the report waits."""
    fig = Figure(60, 30, scale=SMOOTH)
    for size in (SMALL, NORMAL, TITLE):
        fig.text(30, 15, "0.5 x", size)
    fig.rect(1, 1, 20, 20, fill="#4C72B0", outline="white")
    fig.line([(0, 0), (59, 29)], "black", 1)
    fig.save(io.BytesIO())


@dataclass
class Axes:
    """A plotting box (pixel corners left, top, right, bottom) on ``fig`` with data limits; ``xbase``/``ybase``
    make that axis logarithmic; ``yflip`` puts the lower limit at the top."""

    fig: Figure
    box: tuple[float, float, float, float]
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    xbase: float = 0.0
    ybase: float = 0.0
    yflip: bool = False

    def x(self, value: float) -> float:
        return self._map(value, self.xlim, self.xbase, self.box[0], self.box[2])

    def y(self, value: float) -> float:
        top, bottom = (self.box[1], self.box[3]) if not self.yflip else (self.box[3], self.box[1])
        return self._map(value, self.ylim, self.ybase, bottom, top)

    @staticmethod
    def _map(value: float, lim: tuple[float, float], base: float, a: float, b: float) -> float:
        lo, hi = lim
        if base:
            value, lo, hi = (math.log(max(v, 1e-300), base) for v in (value, lo, hi))
        return a + (b - a) * (value - lo) / (hi - lo if hi != lo else 1.0)

    def clip_x(self, x: float) -> float:
        return min(max(x, self.box[0]), self.box[2])

    def bar(self, x0: float, x1: float, y0: float, y1: float, color: str, outline: str | None = None) -> None:
        """A filled rectangle between data corners, clipped to the box."""
        self.fig.rect(self.clip_x(self.x(x0)), self.y(y0), self.clip_x(self.x(x1)), self.y(y1), fill=color,
                      outline=outline, width=0.5)

    def plot(self, xs: list[float], ys: list[float], color: str, width: float = 1.5, dash: float = 0.0,
             dots: float = 0.0) -> None:
        """A line through the data points; ``dots`` > 0: a marker of that radius at each."""
        pts = [(self.x(a), self.y(b)) for a, b in zip(xs, ys, strict=True)]
        if len(pts) > 1:
            self.fig.line(pts, color, width, dash)
        for px, py in pts if dots else []:
            self.fig.dot(px, py, dots, color)

    def hline(self, value: float, color: str = "black", dash: float = 5.0) -> None:
        self.fig.line([(self.box[0], self.y(value)), (self.box[2], self.y(value))], color, 1.2, dash)

    def vline(self, value: float, color: str = "black", dash: float = 5.0) -> None:
        self.fig.line([(self.x(value), self.box[1]), (self.x(value), self.box[3])], color, 1.2, dash)

    def frame(self, left: bool = True, right: bool = True) -> None:
        x0, t, r, b = self.box
        self.fig.line([(x0, t), (r, t)], "black", 1)
        self.fig.line([(x0, b), (r, b)], "black", 1)
        if left:
            self.fig.line([(x0, t), (x0, b)], "black", 1)
        if right:
            self.fig.line([(r, t), (r, b)], "black", 1)

    def xticks(self, ticks: list[float], labels: list[str] | None = None, size: float = SMALL,
               rotate: float = 0.0) -> None:
        labels = labels if labels is not None else [tick_label(t) for t in ticks]
        b = self.box[3]
        for t, label in zip(ticks, labels, strict=True):
            px = self.x(t)
            self.fig.line([(px, b), (px, b + 4)], "black", 1)
            if rotate:
                self.fig.text(px + 3, b + 6, label, size, anchor="rt", rotate=rotate)
            else:
                self.fig.text(px, b + 6, label, size, anchor="mt")

    def yticks(self, ticks: list[float], labels: list[str] | None = None, size: float = SMALL) -> None:
        labels = labels if labels is not None else [tick_label(t) for t in ticks]
        left = self.box[0]
        for t, label in zip(ticks, labels, strict=True):
            py = self.y(t)
            self.fig.line([(left - 4, py), (left, py)], "black", 1)
            self.fig.text(left - 6, py, label, size, anchor="rm")

    def ytick_width(self, labels: list[str], size: float = SMALL) -> float:
        return max((self.fig.text_size(label, size)[0] for label in labels), default=0.0)


__all__ = ["Axes", "Figure", "NORMAL", "SMALL", "SMOOTH", "TITLE", "lighter", "log_ticks", "nice_ticks", "tick_label"]
