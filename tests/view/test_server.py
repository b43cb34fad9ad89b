"""The live server's endpoints (started on port 0 in a thread, fetched with urllib), what it refuses, the
page's escaping, and `verl view` on the command line."""

from __future__ import annotations

import http.client
import json
import re
import sys
import urllib.error
import urllib.request

import pytest
from view_fixtures import HOSTILE_RESPONSE, NEEDLE, TOKEN_VALUE, make_run

from verl.cli.main import main
from verl.errors import ViewError
from verl.view.page import render_page, static_text
from verl.view.runs import Runs, open_runs
from verl.view.server import start_server
from verl.view.values import embed_json


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    runs = Runs(open_runs([make_run(root / "a", steps=4), make_run(root / "b", steps=3, hostile=False, best=False)]))
    server, thread = start_server(runs)
    yield server, root
    server.shutdown()
    server.server_close()
    thread.join(5)


def get(server, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("GET", path, headers={"Host": host} if host else {})
    res = conn.getresponse()
    body = res.read()
    conn.close()
    return res.status, dict(res.getheaders()), body


def api(server, route: str, **params) -> dict:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    with urllib.request.urlopen(f"{server.url}api/{route}?{query}", timeout=10) as res:
        return json.loads(res.read())


def test_the_page_and_its_scripts(served):
    server, _ = served
    assert server.url.startswith("http://127.0.0.1:")
    status, headers, body = get(server, "/")
    assert status == 200 and b'id="js-errors"' in body and b"/static/view.js" in body
    assert "script-src 'self'" in headers["Content-Security-Policy"] and "unsafe-inline" not in \
        headers["Content-Security-Policy"].split("script-src")[1].split(";")[0]
    status, headers, body = get(server, "/static/plotly.min.js")
    assert status == 200 and len(body) > 1_000_000 and headers["Content-Type"].startswith("text/javascript")
    assert get(server, "/static/view.js")[0] == 200


def test_the_api_answers(served):
    server, _ = served
    runs = api(server, "runs")["runs"]
    assert [r["name"] for r in runs] == ["a", "b"] and runs[0]["files"]["tokens.jsonl"]
    metrics = api(server, "metrics", run=0)
    assert [r["step"] for r in metrics["rows"]] == [0, 1, 2, 3, 4] and metrics["best"]["step"] == 4
    assert metrics["rows"][2]["actor/pg_loss"] is None  # NaN in the file, null in strict JSON
    assert api(server, "metrics", run=0, since=3)["rows"][0]["step"] == 3
    steps = api(server, "steps", run=0, source="rollouts")
    assert steps["reward_names"] == ["correct", "format"] and steps["bad_lines"] == 1
    found = api(server, "rows", run=0, source="rollouts", q=NEEDLE)
    assert found["total"] == 1 and NEEDLE in found["rows"][0]["response"]
    page = api(server, "rows", run=0, source="samples", step=0, sort="reward", desc=1)
    assert page["rows"][0]["reward"] == 1.0 and page["rows"][-1]["reward"] is None
    tokens = api(server, "tokens", run=0)
    assert tokens["step"] == 4 and len(tokens["responses"]) == 2 and "logprob_gap" in tokens["names"]
    row = api(server, "token", run=0, id=tokens["responses"][0]["id"])
    assert row["values"]["logprob"][3] == TOKEN_VALUE


def test_the_api_sees_what_a_run_appends(served):
    server, root = served
    before = api(server, "metrics", run=1)["count"]
    with (root / "b" / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 99, "reward/mean": 0.5}\n{"step": 100, "rew')
    newer = api(server, "metrics", run=1, since=before)
    assert [r["step"] for r in newer["rows"]] == [99] and newer["count"] == before + 1


@pytest.mark.parametrize("path", ["/../../etc/passwd", "/static/../runs.py", "/static/%2e%2e/page.py", "/api/../x",
                                  "/a/metrics.jsonl", "/static/", "/api/nope", "//etc/passwd"])
def test_no_path_reaches_the_filesystem(served, path):
    server, _ = served
    status, _, body = get(server, path)
    assert status == 404 and b"root:" not in body


def test_bad_requests_are_answered_with_the_reason(served):
    server, _ = served
    for params, words in [({"run": 7}, "runs 0..1"), ({"run": "x"}, "not an integer"),
                          ({"run": 0, "source": "../../etc"}, "choose samples"),
                          ({"run": 0, "sort": "zzz"}, "sort by one of")]:
        with pytest.raises(urllib.error.HTTPError) as info:
            api(server, "rows", **params)
        assert info.value.code == 400 and words in json.loads(info.value.read())["error"]


def test_a_foreign_host_header_is_refused(served):
    server, _ = served
    assert get(server, "/api/runs", host="evil.example:80")[0] == 403
    assert get(server, "/api/runs", host=f"localhost:{server.server_address[1]}")[0] == 200


def test_embedded_json_cannot_close_its_script_element():
    text = embed_json({"r": HOSTILE_RESPONSE, "x": "a\u2028b", "n": float("nan")})
    assert "<" not in text and ">" not in text and "\u2028" not in text
    assert json.loads(text) == {"r": HOSTILE_RESPONSE, "x": "a\u2028b", "n": None}


def test_the_report_holds_no_markup_from_the_run(tmp_path):
    runs = Runs(open_runs([make_run(tmp_path / "run")]))
    from verl.view.report import report_data

    page = render_page(title="t <script>", data=report_data(runs))
    assert "data-pwned" in page  # the hostile text is there...
    assert "<script>document.body" not in page and "<img src=x" not in page  # ...never as markup
    assert "<title>t &lt;script&gt;</title>" in page
    data = page.split('<script type="application/json" id="verl-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["runs"][0]["name"] == "run"


def test_the_app_never_writes_markup():
    code = static_text("view.js")
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", code)


def test_verl_view_out_writes_one_file(tmp_path, capsys):
    run = make_run(tmp_path / "run", steps=30)
    out = tmp_path / "report.html"
    assert main(["view", str(run), "--out", str(out), "--last-steps", "3", "--max-points", "10"]) == 0
    page = out.read_text(encoding="utf-8")
    assert "wrote" in capsys.readouterr().out and "Plotly" in page and 'src="http' not in page
    data = json.loads(page.split('id="verl-data">', 1)[1].split("</script>", 1)[0])
    assert {r["step"] for r in data["rows"]["0"]["rollouts"]} == {28, 29, 30}
    assert len(data["metrics"]["0"]["rows"]) < 31 and any("thinned" in n for n in data["notes"])
    assert any("keeps the last 3" in n for n in data["notes"])


def test_verl_view_errors(tmp_path, capsys, monkeypatch):
    assert main(["view", str(tmp_path / "missing")]) == 1
    assert "is not a folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "plotly", None)  # not installed
    assert main(["view", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "ViewError" in err and "pip install plotly" in err and ".[view]" in err
    with pytest.raises(ViewError):
        open_runs([])
    monkeypatch.delitem(sys.modules, "plotly")
    assert main(["view", str(tmp_path), "--max-points", "0"]) == 1
    assert "at least 10" in capsys.readouterr().err


def test_a_port_in_use_is_a_clear_error(served):
    server, _ = served
    with pytest.raises(ViewError, match="could not listen on 127.0.0.1:.*choose another --port"):
        main_server(server.server_address[1])
    with pytest.raises(ViewError, match="could not listen"):
        main_server(70000)


def main_server(port: int):
    from verl.view.server import ViewServer

    ViewServer(Runs([]), port).server_close()


def test_import_verl_does_not_import_plotly():
    import subprocess

    code = "import sys, verl, verl.view, verl.cli.main; print('plotly' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
