"""What a page shows in a real browser: headless Chromium loads a copy of it with a probe
script that writes, once every image has loaded, the answer box's text, each plot's name and
decoded size, the tables' row counts and the links into the DOM that ``--dump-dom`` prints.
Skips without a browser, unless FASTMM_REQUIRE_BROWSER=1 (CI) makes that a failure."""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

PROBE = """<script>
window.addEventListener('load', () => {
  const shown = {
    answer: [...document.querySelectorAll('#answer p')].map(p => p.innerText),
    alerts: [...document.querySelectorAll('#answer .alert')].map(a => a.innerText),
    plots: [...document.querySelectorAll('figure[data-plot]')].map(f => {
      const img = f.querySelector('img');
      return {name: f.dataset.plot, width: img ? img.naturalWidth : 0,
              height: img ? img.naturalHeight : 0,
              caption: (f.querySelector('figcaption') || {}).innerText || ''};
    }),
    tables: [...document.querySelectorAll('table')].map(t => t.rows.length),
    links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
    external: [...document.querySelectorAll('[src]')].map(e => e.getAttribute('src'))
      .filter(s => !s.startsWith('data:')),
    width: document.documentElement.scrollWidth,
  };
  const out = document.createElement('pre');
  out.id = 'fastmm-probe';
  out.textContent = JSON.stringify(shown);
  document.body.appendChild(out);
});
</script>"""


def browser() -> str:
    """The headless browser's command, or a skip (a failure under FASTMM_REQUIRE_BROWSER=1)."""
    found = next((b for b in ("chromium", "chromium-browser", "google-chrome")
                  if shutil.which(b)), None)
    if found is None:
        if os.environ.get("FASTMM_REQUIRE_BROWSER") == "1":
            pytest.fail("FASTMM_REQUIRE_BROWSER=1 but no chromium on PATH")
        pytest.skip("no headless browser (apt-get install chromium; FASTMM_REQUIRE_BROWSER=1 "
                    "makes this fail)")
    return found


def render(page: Path) -> dict:
    """What Chromium shows of ``page`` at 1400 px: {answer: [each paragraph of the lead box,
    alerts included], alerts, plots: {name: (decoded width, height)} in page order, captions:
    {name: caption}, tables: [rows of each], links, external (src not inline), width}."""
    command = browser()
    with tempfile.TemporaryDirectory() as tmp:
        probe = page.with_name(f".probe-{page.name}")  # beside it: relative links still resolve
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"),
                         encoding="utf-8")
        try:
            dom = subprocess.run(
                [command, "--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", f"--user-data-dir={tmp}",
                 "--window-size=1400,1000", "--dump-dom", probe.as_uri()],
                capture_output=True, text=True, timeout=120).stdout
        finally:
            probe.unlink()
    start = dom.find('<pre id="fastmm-probe">')
    assert start >= 0, f"the probe did not run: {dom[-500:]!r}"
    text = dom[start + len('<pre id="fastmm-probe">'):dom.index("</pre>", start)]
    seen = json.loads(html.unescape(text))
    names = [p["name"] for p in seen["plots"]]
    assert len(set(names)) == len(names), f"plots share a name: {names}"
    seen["captions"] = {p["name"]: p["caption"] for p in seen["plots"]}
    seen["plots"] = {p["name"]: (p["width"], p["height"]) for p in seen["plots"]}
    return seen
