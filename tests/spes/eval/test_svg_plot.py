"""The offline SVG plots: one polyline per series, its points where the axes put them, a legend, valid XML."""
import xml.etree.ElementTree as ET

from spes.eval.svg_plot import BOTTOM, HEIGHT, LEFT, RIGHT, TOP, WIDTH, line_plot_svg

NS = "{http://www.w3.org/2000/svg}"


def _points(line):
    return [tuple(map(float, p.split(","))) for p in line.get("points").split()]


def test_one_line_per_series_with_points_at_their_axis_positions():
    svg = line_plot_svg({"node 0": [(2, 3.0), (1, 4.0), (3, float("nan"))], "node 1": [(1, 5.0), (3, 2.0)]},
                        "train loss <per node>", "round", "loss")
    root = ET.fromstring(svg)  # well-formed, the title escaped
    lines = root.findall(f"{NS}polyline")
    assert [ln.get("data-series") for ln in lines] == ["node 0", "node 1"]
    p0, p1 = _points(lines[0]), _points(lines[1])
    assert len(p0) == 2 and len(p1) == 2  # the NaN left out; points sorted by x
    left, right, top, bottom = LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM
    assert p0[0] == (left, round(top + (5.0 - 4.0) / 3.0 * (bottom - top), 1))  # x=1 at the left edge, y=4 of 2..5
    assert p1 == [(left, top), (right, bottom)]  # the highest point at the top, the lowest at the bottom
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "train loss <per node>" in texts and "round" in texts and {"node 0", "node 1"} <= set(texts)


def test_a_single_point_and_an_empty_plot_still_draw():
    one = ET.fromstring(line_plot_svg({"held-out": [(5, 4.2)]}, "t", "x", "y"))
    assert len(one.findall(f"{NS}circle")) == 1
    empty = ET.fromstring(line_plot_svg({"held-out": []}, "t", "x", "y", "nothing evaluated"))
    assert not empty.findall(f"{NS}polyline") and "nothing evaluated" in [t.text for t in empty.iter(f"{NS}text")]
