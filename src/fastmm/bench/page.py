"""One small HTML page builder for every benchmark report: a lead box with the answer at the
top, then headings, text, tables and plots. Pages are self-contained (plots are inline PNGs,
no script, no font or style fetched from elsewhere), so a report can be mailed or archived as
one file and opened offline; every piece of text is escaped."""

from __future__ import annotations

import base64
import html
import io
import os
import re
import sys

STYLE = """
body{font:16px/1.5 system-ui,sans-serif;color:#222;max-width:72rem;margin:1.5rem auto;padding:0 1rem}
h1{font-size:1.7rem;margin-bottom:.5rem}h2{margin-top:2rem;border-bottom:1px solid #ddd}
#answer{background:#f3f7fc;border-left:5px solid #4c72b0;padding:.4rem 1.2rem;margin:1rem 0}
#answer p{margin:.6rem 0}#answer p.alert{background:#fff4e5;border-left:4px solid #d9822b;
padding:.3rem .6rem}
code{background:#f2f2f2;padding:0 .2em;border-radius:3px;font-size:90%;overflow-wrap:anywhere}
.scroll{overflow-x:auto;margin:1rem 0}
table{border-collapse:collapse;font-size:90%}th,td{border:1px solid #bbb;padding:.3rem .5rem;
vertical-align:top}th{background:#f2f2f2;text-align:left}tbody tr:nth-child(even){background:#fafafa}
figure{margin:1.2rem 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:90%;color:#555;max-width:60rem}
"""


def _inline(text: str) -> str:
    """Escaped text with `code` spans, **bold** and [links](href) made HTML."""
    out = html.escape(text, quote=True)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r'<a href="\2">\1</a>', out)


def _png(data: bytes, name: str, caption: str) -> str:
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    return (f'<figure data-plot="{html.escape(name)}"><img alt="{html.escape(caption)}" '
            f'src="{uri}"><figcaption>{_inline(caption)}</figcaption></figure>')


class Page:
    """A report page, built top to bottom; ``html()`` gives it, ``write()`` saves it."""

    def __init__(self, title: str):
        self.title = title
        self._lead: list[str] = []  # answer sentences and alerts, in the order given
        self._body: list[str] = []

    def answer(self, sentences: list[str]) -> None:
        """Sentences of the lead box at the top: what a reader came for, with its numbers."""
        self._lead += [f"<p>{_inline(s)}</p>" for s in sentences]

    def alert(self, text: str) -> None:
        """A warning in the lead box, next to the figures it touches (busy machine, a failed
        part): where a reader cannot miss it."""
        self._lead.append(f'<p class="alert">{_inline(text)}</p>')

    def heading(self, text: str, level: int = 2) -> None:
        self._body.append(f"<h{level}>{_inline(text)}</h{level}>")

    def text(self, text: str) -> None:
        self._body.append(f"<p>{_inline(text)}</p>")

    def items(self, items: list[str]) -> None:
        self._body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        """A table that scrolls sideways when it is wider than the page."""
        head = "".join(f"<th>{_inline(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>"
                       for row in rows)
        self._body.append(f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
                          f"<tbody>{body}</tbody></table></div>")

    def plot(self, name: str, fig, caption: str) -> None:
        """``fig`` (a matplotlib Figure) as an inline PNG; the figure is closed."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:  # a figure pyplot made stays in its registry until closed
            pyplot.close(fig)
        self._body.append(_png(buf.getvalue(), name, caption))

    def link(self, href: str, text: str) -> None:
        self._body.append(f'<p><a href="{html.escape(href)}">{_inline(text)}</a></p>')

    def markdown(self, md: str, base: str | None = None) -> None:
        """A Markdown export rendered here: headings, paragraphs (a line ending in two spaces
        breaks), "- " lists, pipe tables, `code`, and images, inlined from ``base``."""
        block: list[str] = []  # the lines of the paragraph, list or table being read
        kind = None

        def flush():
            if kind == "para":
                self._body.append("<p>" + "".join(
                    _inline(x.rstrip()) + ("<br>" if x.endswith("  ") else " ")
                    for x in block[:-1]) + _inline(block[-1].strip()) + "</p>")
            elif kind == "list":
                self.items(block)
            elif kind == "table":
                rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in block]
                if len(rows) > 1 and all(re.fullmatch(r":?-+:?", c) for c in rows[1]):
                    del rows[1]  # the |---| row under the header
                self.table(rows[0], rows[1:])
            block.clear()

        for line in md.splitlines():
            image = re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip())
            new = ("table" if line.startswith("|") else "list" if line.startswith("- ") else
                   None if not line.strip() or image or line.startswith("#") else
                   "list" if kind == "list" else "para")  # a line under an item continues it
            if new != kind:
                flush()
                kind = new
            if image:
                alt, src = image.groups()
                with open(os.path.join(base or ".", src), "rb") as f:
                    self._body.append(_png(f.read(), os.path.splitext(os.path.basename(src))[0],
                                           alt))
            elif line.startswith("#"):
                level = min(6, len(line) - len(line.lstrip("#")))
                self.heading(line.lstrip("#").strip(), level)
            elif kind == "list" and not line.startswith("- "):
                block[-1] += " " + line.strip()
            elif kind == "list":
                block.append(line[2:])
            elif kind:
                block.append(line)
        flush()

    def html(self) -> str:
        lead = f'<section id="answer">{"".join(self._lead)}</section>' if self._lead else ""
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
                f"<title>{html.escape(self.title)}</title><style>{STYLE}</style></head>"
                f"<body><h1>{_inline(self.title)}</h1>{lead}{''.join(self._body)}</body></html>\n")

    def write(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html())
        return path
