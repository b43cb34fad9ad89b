"""The live `verl view` server: the page, its scripts, and the JSON API, on 127.0.0.1 only.

The standard library's ThreadingHTTPServer is enough for one person's browser. Only a fixed set of paths is
served (the page, three static files, `/api/<route>`); a request never names a file, so nothing outside the
run folders' four files can be read through it. Requests whose Host header is not this loopback address are
refused, so a web page elsewhere cannot reach the API by pointing a DNS name at 127.0.0.1.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

from verl.errors import ViewError
from verl.view.page import LIVE_CSP, plotly_js, render_page, static_text
from verl.view.runs import Runs
from verl.view.values import dumps

HOST = "127.0.0.1"
STATIC_TYPES = {"view.js": "text/javascript", "boot.js": "text/javascript", "view.css": "text/css",
                "plotly.min.js": "text/javascript"}
API_ROUTES = ("runs", "metrics", "steps", "rows", "tokens", "token")


class ViewServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, runs: Runs, port: int = 0) -> None:
        self.runs = runs
        self.title = f"verl view: {', '.join(r.name for r in runs.runs)}"
        try:
            super().__init__((HOST, port), ViewHandler)
        except (OSError, OverflowError) as exc:  # OverflowError: a port over 65535
            why = getattr(exc, "strerror", None) or exc
            raise ViewError(f"verl view could not listen on {HOST}:{port} ({why}). Fix: choose another --port, or "
                            "leave it out for a free one") from None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}/"


class ViewHandler(BaseHTTPRequestHandler):
    server: ViewServer
    server_version = "verl-view"

    def log_message(self, format: str, *args) -> None:  # noqa: A002  (the base class's name)
        """Quiet: the terminal shows the URL, not a line per poll."""

    def _send(self, status: int, body: bytes, content_type: str, *, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        if content_type.startswith("text/html"):
            self.send_header("Content-Security-Policy", LIVE_CSP)
            self.send_header("X-Frame-Options", "DENY")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, dumps(obj).encode("utf-8"), "application/json; charset=utf-8")

    def _host_ok(self) -> bool:
        port = self.server.server_address[1]
        return self.headers.get("Host", "") in (f"{HOST}:{port}", f"localhost:{port}")

    def do_HEAD(self) -> None:  # noqa: N802  (the base class's name)
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        if not self._host_ok():
            self._json(403, {"error": "this server answers only requests to its own loopback address"})
            return
        url = urlsplit(self.path)
        path = url.path
        if path in ("/", "/index.html"):
            self._send(200, render_page(title=self.server.title).encode("utf-8"), "text/html; charset=utf-8")
        elif path.startswith("/static/") and path[len("/static/"):] in STATIC_TYPES:
            name = path[len("/static/"):]
            text = plotly_js() if name == "plotly.min.js" else static_text(name)
            self._send(200, text.encode("utf-8"), f"{STATIC_TYPES[name]}; charset=utf-8", cache=name == "plotly.min.js")
        elif path.startswith("/api/") and path[len("/api/"):] in API_ROUTES:
            params = dict(parse_qsl(url.query, keep_blank_values=True))
            try:
                answer = self.server.runs.answer(path[len("/api/"):], params)
            except ViewError as exc:
                self._json(400, {"error": str(exc)})
                return
            except OSError as exc:  # a file vanished between the index and the read: the next poll starts over
                self._json(503, {"error": f"a run file changed while it was read ({exc.strerror or exc}); retry"})
                return
            self._json(200, answer)
        else:
            self._json(404, {"error": f"no such page: {path[:200]}"})


def start_server(runs: Runs, port: int = 0) -> tuple[ViewServer, threading.Thread]:
    """Serve in a background thread (tests, scripts); `server.shutdown()` stops it."""
    server = ViewServer(runs, port)
    thread = threading.Thread(target=server.serve_forever, name="verl-view", daemon=True)
    thread.start()
    return server, thread


__all__ = ["HOST", "ViewServer", "start_server"]
