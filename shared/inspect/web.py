"""`millstream inspect RUN_DIR --serve`: the trajectory store on a local web page.

One page (shared/inspect/page.html, plain HTML and JavaScript: no build step, nothing loaded
from the internet) and three JSON endpoints it calls:

    GET /api/episodes?cause=&fate=&env=&group=&request=&text=&step=A:B&reward_min=&reward_max=&limit=
    GET /api/episode/<row id>     one episode token by token (shared/inspect/query.py (describe_episode))
    GET /api/counts?...           how many match, by fate and cause

Why the standard library's threaded HTTP server: a read-only viewer for one person needs no
framework, and each request opens its own read-only connection, so the page follows a live run.
It binds loopback only: the store holds every prompt and reply of the run, so it is not served
to the network (an SSH tunnel shows it on another machine).
"""

from __future__ import annotations

import ipaddress
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import orjson

from millstream.shared.inspect.query import (
    FilterError,
    Filters,
    Pieces,
    count_episodes,
    describe_episode,
    find_episodes,
    parse_range,
)
from millstream.shared.store.trajstore import STORE_FILE, open_store

__all__ = ["serve", "start_server", "filters_from_query"]

PAGE = "page.html"


def filters_from_query(query: dict[str, list[str]]) -> Filters:
    """The page's query string as `Filters` (the same names as the command line's options)."""

    def one(name: str) -> str | None:
        value = query.get(name, [""])[0].strip()
        return value or None

    def number(name: str) -> float | None:
        value = one(name)
        try:
            return None if value is None else float(value)
        except ValueError:
            raise FilterError(f"{name} must be a number, got {value!r}") from None

    step = one("step")
    limit = one("limit")
    return Filters(
        step=parse_range(step, "step") if step else (None, None),
        reward_min=number("reward_min"),
        reward_max=number("reward_max"),
        cause=one("cause"),
        fate=one("fate"),
        env=one("env"),
        group=one("group"),
        request=one("request"),
        text=one("text"),
        limit=int(number("limit") or 100) if limit else 100,
    )


class _Handler(BaseHTTPRequestHandler):
    store: Path
    pieces: Pieces
    page: bytes

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        try:
            if url.path in ("/", "/index.html"):
                return self._send(HTTPStatus.OK, self.page, "text/html; charset=utf-8")
            if url.path.startswith("/api/"):
                return self._json(HTTPStatus.OK, self._answer(url.path, query))
            return self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path}"})
        except FilterError as exc:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except FileNotFoundError as exc:
            return self._json(HTTPStatus.NOT_FOUND, {"error": str(exc)})

    def _answer(self, path: str, query: dict[str, list[str]]) -> Any:
        db = open_store(self.store, readonly=True)
        try:
            if path == "/api/episodes":
                return find_episodes(db, filters_from_query(query))
            if path == "/api/counts":
                return count_episodes(db, filters_from_query(query))
            if path.startswith("/api/episode/"):
                key = path.removeprefix("/api/episode/")
                if not key.isdigit():
                    raise FilterError(f"episode row id must be a number, got {key!r}")
                return describe_episode(db, int(key), self.pieces)
            raise FilterError(f"no endpoint {path}")
        finally:
            db.close()

    def _json(self, status: HTTPStatus, body: Any) -> None:
        self._send(status, orjson.dumps(body), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")  # a live run changes under the page
        self.end_headers()
        self.wfile.write(body)


def start_server(
    run_dir: Path, host: str = "127.0.0.1", port: int = 0
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve `run_dir`'s store on a thread; returns the server (its `server_address` has the
    port) and the thread. `server.shutdown()` stops it."""
    if not ipaddress.ip_address(host).is_loopback:
        raise FilterError(
            f"--host {host} is not a loopback address: the store is served to this machine only"
        )
    store = run_dir / STORE_FILE
    if not store.is_file():
        raise FileNotFoundError(f"no trajectory store at {store}")
    handler = type(
        "Handler",
        (_Handler,),
        {
            "store": store,
            "pieces": Pieces.for_run(run_dir),
            "page": resources.files(__package__).joinpath(PAGE).read_bytes(),
        },
    )
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    return server, thread


def serve(run_dir: Path, host: str, port: int) -> int:
    server, thread = start_server(run_dir, host, port)
    bound_port = server.server_address[1]
    print(f"millstream inspect: http://{host}:{bound_port}/  (Ctrl-C stops)", flush=True)
    try:
        while thread.is_alive():
            thread.join(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0
