"""`verl view` in a real browser: headless Chromium loads the report and the live page, runs their scripts, and
the DOM after that must show the run's values with no JavaScript error (the page writes every error and
unhandled rejection into #js-errors). Few launches on purpose: each costs seconds.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from urllib.parse import urlencode

import pytest
from view_fixtures import NEEDLE, TOKEN_VALUE, make_run

from verl.view.report import write_report
from verl.view.runs import Runs, open_runs
from verl.view.server import start_server

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium / chromium-browser / google-chrome on PATH "
                                "(Debian: apt-get install chromium; .ci/run installs it)")


def dump_dom(url: str, budget_ms: int = 10000) -> str:
    """The document after its scripts ran (virtual time: timers and polls run without waiting)."""
    out = subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "</html>" in out.stdout, out.stderr[-2000:]
    return out.stdout


def js_errors(dom: str) -> str:
    found = re.search(r'<pre id="js-errors"[^>]*>(.*?)</pre>', dom, re.S)
    assert found, "the page has no #js-errors element"
    return html.unescape(found.group(1))


def body_attributes(dom: str) -> str:
    return re.search(r"<body([^>]*)>", dom).group(1)


def checked(dom: str, view: str) -> str:
    assert js_errors(dom) == ""
    assert f'data-ready="{view}"' in body_attributes(dom), "the view never finished rendering"
    assert "pwned" not in body_attributes(dom)  # no script from the run's text ran
    return dom


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("report")
    runs = Runs(open_runs([make_run(root / "first", steps=6), make_run(root / "second", steps=8, hostile=False,
                                                                        best=False, seed=0.1)]))
    return write_report(runs, root / "report.html").as_uri()


def test_report_metrics_charts(report):
    dom = checked(dump_dom(report + "#metrics"), "metrics")
    for name in ("reward/mean", "actor/pg_loss", "val/accuracy", "custom_prefix/thing", "episode/turns_mean"):
        assert f'data-metric="{name}"' in dom
    assert "old_run/only_in_rotated" not in dom  # the rotated metrics.jsonl.1 is another run
    assert dom.count('class="main-svg"') >= 10 and "js-plotly-plot" in dom
    assert "best checkpoint: first step 4" in dom and "step time by stage (seconds): first" in dom
    for group in ("reward", "val", "actor", "timing", "custom_prefix"):
        assert f'data-group="{group}"' in dom


def test_report_samples_filtered_by_the_url_and_hostile_text_stays_text(report):
    dom = checked(dump_dom(report + "#samples?source=rollouts&q=data-pwned"), "samples")
    rows = re.findall(r'<tr data-id="\d+">', dom)
    assert len(rows) == 1 and "rows 1–1 of 1" in dom
    assert "&lt;script&gt;document.body.setAttribute('data-pwned','1')&lt;/script&gt;" in dom


def test_report_episodes_and_tokens(report, tmp_path):
    dom = checked(dump_dom(report + "#episodes?status=bad"), "episodes")
    assert 'data-status="timeout"' in dom and 'data-status="failed"' in dom and 'data-status="ok"' not in dom
    assert 'class="turn trained"' in dom and 'class="turn observation"' in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;42" in dom and "error: exit 1" in dom and "tool_calls 1" in dom
    dom = checked(dump_dom(report + "#tokens?step=2&value=logprob"), "tokens")
    marked = re.search(r'<span class="tok clipped" title="([^"]*)"[^>]*style="background: ([^"]*)"', dom)
    assert marked, "the clipped token with its colour is missing"
    title = html.unescape(marked.group(1))
    assert f"logprob: {TOKEN_VALUE}" in title and 'token "<b>tok</b>"' in title and "ratio: 1.3" in title
    assert marked.group(2).startswith("rgba(255, 140, 0")  # coloured by the chosen value
    assert 'class="tok masked"' in dom and "logprob_gap: –" in html.unescape(dom)  # NaN in the file: no value


def test_live_page_filters_on_the_server_and_polls(tmp_path):
    run = make_run(tmp_path / "live", steps=4)
    server, thread = start_server(Runs(open_runs([run])))
    try:
        dom = checked(dump_dom(server.url + f"#samples?q={NEEDLE}"), "samples")
        assert len(re.findall(r'<tr data-id="\d+">', dom)) == 1 and f"the {NEEDLE} answer" in dom
        dom = checked(dump_dom(server.url + "#metrics?smooth=0.5"), "metrics")
        assert 'data-metric="reward/mean"' in dom and dom.count('class="main-svg"') >= 10
        assert "live · updated" in dom  # a poll ran and the server answered
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.slow
def test_a_real_demo_run_in_the_browser(tmp_path):
    """The built-in demo's run folder (its trainer writes all four files): every view shows its values."""
    run = tmp_path / "demo"
    subprocess.run([sys.executable, "-m", "verl.cli.main", "train", "trainer.total_steps=3", f"trainer.run_dir={run}"],
                   check=True, capture_output=True, timeout=600, cwd=tmp_path)
    report = write_report(Runs(open_runs([run])), tmp_path / "report.html").as_uri()
    dom = checked(dump_dom(report + "#metrics"), "metrics")
    assert 'data-metric="reward/mean"' in dom and 'data-metric="val/accuracy"' in dom
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    first = rollouts[0]
    query = urlencode({"q": first["prompt"], "step": first["step"]})
    dom = samples_dom = checked(dump_dom(report + f"#samples?{query}"), "samples")
    shown = re.findall(r'<tr data-id="\d+">(.*?)</tr>', dom, re.S)
    same = [r for r in rollouts if r["step"] == first["step"] and first["prompt"] in r["prompt"]]
    assert len(shown) == len(same) and all(html.escape(first["prompt"], quote=False) in row for row in shown)
    token = json.loads((run / "tokens.jsonl").read_text().splitlines()[0])
    # the sampler's log-probs are on every row (the loss's own values only where the update ran the row)
    dom = checked(dump_dom(report + f"#tokens?step={token['step']}&id=0&value=sampler_logprob"), "tokens")
    titles = [html.unescape(t) for t in re.findall(r'<span class="tok[^"]*" title="([^"]*)"', dom)]
    assert len(titles) == len(token["tokens"])
    value = token["values"]["sampler_logprob"][0]
    assert f"sampler_logprob: {float(f'{value:.6g}')}" in titles[0]
    # a rollout links to its token values: the tokens.jsonl row of the same step and sample number
    assert f'href="#tokens?step={first["step"]}&amp;sample={first["sample"]}"' in samples_dom
    second = next(json.loads(line) for line in (run / "tokens.jsonl").read_text().splitlines()
                  if json.loads(line)["step"] == token["step"] and json.loads(line)["sample"] == 1)
    dom = checked(dump_dom(report + f"#tokens?step={token['step']}&sample=1&value=sampler_logprob"), "tokens")
    titles = [html.unescape(t) for t in re.findall(r'<span class="tok[^"]*" title="([^"]*)"', dom)]
    assert len(titles) == len(second["tokens"]) and not re.search(r'<div class="error">[^<]*no token values', dom)
    value = second["values"]["sampler_logprob"][0]
    assert f"sampler_logprob: {float(f'{value:.6g}')}" in titles[0]
    checked(dump_dom(report + "#episodes"), "episodes")
