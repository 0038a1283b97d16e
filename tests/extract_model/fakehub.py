"""A Hugging Face Hub on 127.0.0.1 serving model repositories from local directories, answering the calls
huggingface_hub makes (`HF_ENDPOINT` points it here) and recording every request.

Calls answered, as the Hub answers them (huggingface_hub 2.x, `hf_api.py` and `file_download.py`):

- `GET /api/models/{repo}/revision/{rev}`: the repo's info, its commit `sha` and `siblings`;
- `GET /api/models/{repo}/tree/{rev}`: the files, with sizes (one page: no `Link` header);
- `HEAD` and `GET /{repo}/resolve/{rev}/{file}`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length`.

Anything else is a 404 with the Hub's `X-Error-Code`.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import pathlib
import re
import threading
import urllib.parse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, pathlib.Path]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, repo: str) -> list[str]:
        """The files of `repo` whose bytes were sent (GET of a resolve URL)."""
        prefix = f"/{repo}/resolve/"
        return [path[len(prefix):].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and path.startswith(prefix)]  # fmt: skip

    def _files(self, repo: str) -> list[pathlib.Path]:
        return sorted(p for p in self.repos[repo].iterdir() if p.is_file())

    def _answer(self, handler: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = urllib.parse.urlsplit(handler.path).path
        self.requests.append((handler.command, path))
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/[^/]+", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+(?:/.*)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo = next((m.group(1) for m in (info, tree, resolve) if m), None)
        if repo not in self.repos:
            return self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        if info:
            siblings = [{"rfilename": p.name} for p in self._files(repo)]
            return self._json(handler, {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings}, body)
        if tree:
            entries = [{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": self._etag(p)}
                       for p in self._files(repo)]  # fmt: skip
            return self._json(handler, entries, body)
        file = self.repos[repo] / resolve.group(2)
        if not file.is_file():
            return self._send(handler, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})
        data = file.read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self._etag(file)}"'}
        self._send(handler, 200, data if body else b"", headers, length=len(data))

    @staticmethod
    def _etag(path: pathlib.Path) -> str:
        return hashlib.sha1(path.read_bytes()).hexdigest()

    def _json(self, handler, value, body: bool) -> None:
        data = json.dumps(value).encode()
        self._send(handler, 200, data if body else b"", {"Content-Type": "application/json"}, length=len(data))

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict[str, str], length: int | None = None) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data) if length is None else length))
        handler.end_headers()
        if data:
            handler.wfile.write(data)
