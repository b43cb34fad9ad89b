"""The viewer's HTML: one page for both the live server and the `--out` report.

The live page loads its scripts from the server (so its Content-Security-Policy allows no inline script at
all) and asks the JSON API; the report inlines plotly, the app and the data, and answers the same questions
in the browser. Everything a run wrote reaches the page as JSON and is put into the document with
textContent, never as markup; embedded JSON has no `<`, so a `</script>` in a response stays text.
"""

from __future__ import annotations

import html
from functools import cache
from importlib.resources import files
from typing import Any

from verl.errors import ViewError, install_hint
from verl.view.values import embed_json

PLOTLY_HINT = install_hint("plotly", "view")
STATIC = ("boot.js", "view.js", "view.css")
LIVE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'")
REPORT_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
              "img-src data:; base-uri 'none'; form-action 'none'")


def require_plotly() -> None:
    """Fail before anything starts when plotly, which draws the charts, is not installed."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ViewError(f"verl view draws its charts with plotly, which is not installed. Fix: {PLOTLY_HINT}") from None


@cache
def plotly_js() -> str:
    """plotly.js from the installed plotly package (it ships the file: no network needed)."""
    require_plotly()
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


@cache
def static_text(name: str) -> str:
    if name not in STATIC:
        raise ViewError(f"no static file {name!r}")
    return files("verl.view").joinpath("static", name).read_text(encoding="utf-8")


def _inline_script(code: str) -> str:
    if "</script" in code.lower():
        raise ViewError("a script to inline contains '</script': it would end its element early")
    return f"<script>{code}</script>"


BODY = """<header>
  <h1>verl view</h1><span id="run-names"></span>
  <nav id="tabs">
    <a href="#metrics" data-view="metrics">Metrics</a><a href="#samples" data-view="samples">Samples</a>
    <a href="#episodes" data-view="episodes">Episodes</a><a href="#tokens" data-view="tokens">Tokens</a>
  </nav><span id="status"></span>
</header>
<div id="notes"></div>
<pre id="js-errors" hidden></pre>
<main>
  <section id="view-metrics" class="view" hidden></section>
  <section id="view-samples" class="view" hidden></section>
  <section id="view-episodes" class="view" hidden></section>
  <section id="view-tokens" class="view" hidden></section>
</main>
"""


def render_page(*, title: str, data: dict[str, Any] | None = None) -> str:
    """The page. `data` None: the live page (scripts and data from the server); else the self-contained
    report with `data` embedded."""
    head = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>",
            '<meta name="viewport" content="width=device-width, initial-scale=1">']
    if data is None:
        head += [f'<meta http-equiv="Content-Security-Policy" content="{LIVE_CSP}">',
                 '<link rel="stylesheet" href="/static/view.css">', '<script src="/static/boot.js"></script>']
        tail = ['<script src="/static/plotly.min.js"></script>', '<script src="/static/view.js"></script>']
    else:
        head += [f'<meta http-equiv="Content-Security-Policy" content="{REPORT_CSP}">',
                 f"<style>{static_text('view.css')}</style>", _inline_script(static_text("boot.js"))]
        tail = [f'<script type="application/json" id="verl-data">{embed_json(data)}</script>',
                _inline_script(plotly_js()), _inline_script(static_text("view.js"))]
    return "\n".join([*head, "</head><body>", BODY, *tail, "</body></html>\n"])


__all__ = ["LIVE_CSP", "PLOTLY_HINT", "plotly_js", "render_page", "require_plotly", "static_text"]
