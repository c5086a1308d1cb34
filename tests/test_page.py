"""The report page builder: exact HTML for each piece (text escaped, `code` spans, tables,
Markdown), and in a real browser: the plots decode to images of a known size, nothing is
fetched from elsewhere, and the page fits 1400 px."""

from __future__ import annotations

import base64
import re

import pytest

pytest.importorskip("matplotlib")

from fastmm.bench import plots, stats  # noqa: E402
from fastmm.bench.page import Page  # noqa: E402

from _browser import render  # noqa: E402


def _body(page: Page) -> str:
    html = page.html()
    return html[html.index("</h1>") + 5:html.index("</body>")]


def test_text_is_escaped_and_code_spans_become_code():
    page = Page('Rates <"fast"> & slow')
    page.text("a < b & `x<y>` then `z`")
    page.items(["one `1`", "<two>"])
    page.heading("H & `h`", 3)
    page.link("a b/report.html?x=1&y=2", "the <report>")
    html = page.html()
    assert "<title>Rates &lt;&quot;fast&quot;&gt; &amp; slow</title>" in html
    assert "<h1>Rates &lt;&quot;fast&quot;&gt; &amp; slow</h1>" in html
    assert _body(page) == (
        "<p>a &lt; b &amp; <code>x&lt;y&gt;</code> then <code>z</code></p>"
        "<ul><li>one <code>1</code></li><li>&lt;two&gt;</li></ul>"
        "<h3>H &amp; <code>h</code></h3>"
        '<p><a href="a b/report.html?x=1&amp;y=2">the &lt;report&gt;</a></p>')


def test_answer_and_alerts_share_the_lead_box_in_the_order_given():
    page = Page("t")
    assert "<section" not in page.html()  # no lead box without a lead
    page.answer(["fastmm 1.11x [1.02-1.39] (95% CI)", "second"])
    page.alert("2 of 6 <busy>")
    page.answer(["third"])
    assert ('<section id="answer"><p>fastmm 1.11x [1.02-1.39] (95% CI)</p><p>second</p>'
            '<p class="alert">2 of 6 &lt;busy&gt;</p><p>third</p></section>') in page.html()


def test_table_scrolls_and_escapes_every_cell():
    page = Page("t")
    page.table(["arm", "a|b"], [["<torch>", "`1.0x`"], ["fastmm", ""]])
    assert _body(page) == (
        '<div class="scroll"><table><thead><tr><th>arm</th><th>a|b</th></tr></thead><tbody>'
        "<tr><td>&lt;torch&gt;</td><td><code>1.0x</code></td></tr>"
        "<tr><td>fastmm</td><td></td></tr></tbody></table></div>")


def test_markdown_export_renders_as_the_same_pieces(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1))
    fig.add_subplot().plot([0, 1])
    fig.savefig(tmp_path / "ratios.png")
    md = ("# Report\n\nCommand: `x --y`  \nDate: today\nstill today\n\n- one\n- two `t`\n"
          "  more of two\n\n| a | b |\n|---|:-:|\n| 1 | <2> |\n| - | - |\n\n![ratios to baseline](ratios.png)\n"
          "## Next\nSee [the page](a.html).\n")
    page = Page("t")
    page.markdown(md, base=str(tmp_path))
    body = _body(page)
    png = base64.b64encode((tmp_path / "ratios.png").read_bytes()).decode()
    assert body == (
        "<h1>Report</h1>"
        "<p>Command: <code>x --y</code><br>Date: today still today</p>"
        "<ul><li>one</li><li>two <code>t</code> more of two</li></ul>"
        '<div class="scroll"><table><thead><tr><th>a</th><th>b</th></tr></thead><tbody>'
        "<tr><td>1</td><td>&lt;2&gt;</td></tr><tr><td>-</td><td>-</td></tr></tbody></table></div>"
        f'<figure data-plot="ratios"><img alt="ratios to baseline" src="data:image/png;base64,{png}">'
        "<figcaption>ratios to baseline</figcaption></figure>"
        "<h2>Next</h2>"
        '<p>See <a href="a.html">the page</a>.</p>')
    tight = Page("t")  # blocks with no blank line between them keep their order
    tight.markdown("para\n| x |\n|---|\n| 1 |\nafter\n- item\n# H")
    assert _body(tight) == (
        '<p>para</p><div class="scroll"><table><thead><tr><th>x</th></tr></thead><tbody>'
        "<tr><td>1</td></tr></tbody></table></div><p>after</p><ul><li>item</li></ul><h1>H</h1>")


def test_plots_decode_in_a_browser_and_nothing_is_fetched(tmp_path):
    page = Page("plots")
    page.answer(["the answer"])
    rows = [("torch", stats.summarize([400, 420, 380, 410, 405, 399])),
            ("fastmm", stats.summarize([1400, 1420, 1380])), ("skipped", None)]
    page.plot("rates", plots.rates(rows, "samples/s"), "rates <caption>")
    page.plot("dist", plots.distributions({"torch": [0.01, 0.02, 0.05], "fastmm": [0.001, 0.002]},
                                          "queue wait, s"), "d")
    page.plot("mem", plots.over_time({"torch": ([0, 1, 2], [1e9, 1.2e9, 1.1e9])}, "MiB",
                                     2**-20), "m")
    page.plot("break-even", plots.break_even(10.0, 14.0, 2.7), "b")
    page.plot("crossover", plots.crossover({"small": (900.0, {1: 300.0, 8: 2000.0})},
                                           "images/s"), "c")
    page.table(["a"], [["1"]] * 3)
    path = page.write(str(tmp_path / "p.html"))
    assert path == str(tmp_path / "p.html")
    assert (tmp_path / "p.html").read_text(encoding="utf-8") == page.html()
    assert not re.search(r'src="(?!data:)', page.html())
    seen = render(tmp_path / "p.html")
    assert seen["answer"] == ["the answer"] and seen["alerts"] == []
    assert list(seen["plots"]) == ["rates", "dist", "mem", "break-even",
                                                  "crossover"]
    for name, (width, height) in seen["plots"].items():  # 10 inches at 100 dpi, a few high
        assert width == 1000 and 150 < height < 600, name
    assert seen["captions"]["rates"] == "rates <caption>"
    assert seen["tables"] == [4] and seen["external"] == []
    assert seen["width"] <= 1400  # nothing wider than the window: no sideways scrolling


def test_a_closed_pyplot_figure_is_released():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    Page("t").plot("x", fig, "x")
    assert not plt.fignum_exists(fig.number)
