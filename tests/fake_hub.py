"""A local stand-in for the Hub API calls `recycle push` makes through huggingface_hub (2.4.0).

Endpoints (as huggingface_hub builds them, read from its hf_api.py / _commit_api.py):
  POST /api/repos/create                           create_repo: {name, organization, type, visibility?}
  GET  /api/models/{owner}/{name}[/revision/{rev}] repo_info: create_repo(exist_ok) calls it after a 401/403
  POST /api/models/{owner}/{name}/branch/{branch}  create_branch (409 when it exists)
  POST /api/validate-yaml                          create_commit checks a README.md's metadata first
  POST /api/models/{owner}/{name}/preupload/{rev}  upload modes; this server says "regular" for every
                                                   file, so contents travel base64 in the commit
                                                   (no LFS batch / Xet transfer to imitate)
  POST /api/models/{owner}/{name}/commit/{rev}     the commit: NDJSON, a header line then one line per file
  GET  /api/agent-harnesses                        fetched (no token) once a day by huggingface_hub's
                                                   request headers (utils/_detect_agent.py), from
                                                   huggingface_hub.constants.ENDPOINT
Anything else is answered 404 and recorded in `unexpected`.

Modes: "ok"; "reject" (401 to everything, as the Hub answers a bad token); "drop_commit" (reads
the commit request, then closes the socket without answering); "drop" (the same for every request).
`commit_failures` > 0 makes that many commit requests fail first, by `commit_failure`: "drop" or an
HTTP status such as 503.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Commit:
    repo: str
    revision: str
    summary: str
    description: str
    files: dict[str, bytes]


@dataclass
class FakeHub:
    mode: str = "ok"
    commit_failures: int = 0
    commit_failure: str | int = "drop"
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    auth: list[str | None] = field(default_factory=list)  # Authorization header of each request
    bodies: list[bytes] = field(default_factory=list)
    repos: dict[str, dict] = field(default_factory=dict)  # repo id -> create payload
    branches: dict[str, set[str]] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    validated: list[str] = field(default_factory=list)  # README contents sent to validate-yaml
    unexpected: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""

    def hits(self, kind: str) -> int:
        """Requests to one endpoint kind: create, branch, validate, preupload, commit, info, harnesses."""
        return sum(_kind(m, urlsplit(p).path.split("/")) == kind for m, p in self.requests)


def _kind(method: str, parts: list[str]) -> str | None:
    # parts of "/api/models/o/n/commit/main" -> ["", "api", "models", "o", "n", "commit", "main"]
    if parts[1:4] == ["api", "repos", "create"] and method == "POST":
        return "create"
    if parts[1:3] == ["api", "validate-yaml"] and method == "POST":
        return "validate"
    if parts[1:3] == ["api", "agent-harnesses"] and method == "GET":
        return "harnesses"
    if len(parts) >= 5 and parts[1:3] == ["api", "models"]:
        if len(parts) == 7 and method == "POST" and parts[5] in ("branch", "preupload", "commit"):
            return parts[5]
        if method == "GET" and (len(parts) == 5 or parts[5] == "revision"):
            return "info"
    return None


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _reply(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("X-Error-Message", "Invalid credentials in Authorization header")
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hub.requests.append((method, self.path))
            hub.auth.append(self.headers.get("Authorization"))
            hub.bodies.append(body)
            parts = urlsplit(self.path).path.split("/")
            kind = _kind(method, parts)
            failing = kind == "commit" and hub.commit_failures > 0
            if failing:
                hub.commit_failures -= 1
            if hub.mode == "drop" or (hub.mode == "drop_commit" and kind == "commit") or \
                    (failing and hub.commit_failure == "drop"):
                self.close_connection = True  # no status line: the client sees the socket close
                return
            if failing:
                self._reply(int(hub.commit_failure), {"error": "Service Unavailable"})
                return
            if hub.mode == "reject":
                self._reply(401, {"error": "Invalid credentials in Authorization header"})
                return
            if kind is None:
                hub.unexpected.append((method, self.path))
                self._reply(404, {"error": f"the fake Hub does not implement {method} {self.path}"})
                return
            getattr(self, f"_{kind}")(parts, json.loads(body) if kind in ("create", "validate", "preupload") else None,
                                      body)

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def _create(self, parts, payload, body) -> None:
            repo = f"{payload['organization']}/{payload['name']}"
            if repo in hub.repos:
                self._reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo}"})
                return
            hub.repos[repo] = payload
            hub.branches[repo] = {"main"}
            self._reply(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": hashlib.sha1(repo.encode()).hexdigest()})

        def _harnesses(self, parts, payload, body) -> None:
            self._reply(200, {"standardEnvVars": [], "harnesses": {}})

        def _info(self, parts, payload, body) -> None:
            repo = f"{parts[3]}/{parts[4]}"
            if repo not in hub.repos:
                self._reply(404, {"error": "Repository not found"})
                return
            self._reply(200, {"id": repo, "sha": "0" * 40, "siblings": []})

        def _branch(self, parts, payload, body) -> None:
            repo, branch = f"{parts[3]}/{parts[4]}", unquote(parts[6])
            if repo not in hub.repos:
                self._reply(404, {"error": "Repository not found"})
            elif branch in hub.branches[repo]:
                self._reply(409, {"error": "Reference already exists"})
            else:
                hub.branches[repo].add(branch)
                self._reply(200, {})

        def _validate(self, parts, payload, body) -> None:
            hub.validated.append(payload["content"])
            self._reply(200, {"errors": [], "warnings": []})

        def _preupload(self, parts, payload, body) -> None:
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                     for f in payload["files"]]
            self._reply(200, {"files": files, "commitOid": "0" * 40})

        def _commit(self, parts, payload, body) -> None:
            repo, revision = f"{parts[3]}/{parts[4]}", unquote(parts[6])
            if repo not in hub.repos or revision not in hub.branches[repo]:
                self._reply(404, {"error": f"{repo}@{revision} not found"})
                return
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = lines[0]["value"]
            files = {}
            for line in lines[1:]:
                assert line["key"] == "file" and line["value"]["encoding"] == "base64", line["key"]
                files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            hub.commits.append(Commit(repo, revision, header["summary"], header.get("description", ""), files))
            oid = hashlib.sha1(body).hexdigest()
            self._reply(200, {"success": True, "commitOid": oid, "commitUrl": f"{hub.url}/{repo}/commit/{oid}",
                              "pullRequestUrl": None})

    return Handler


class FakeHubServer:
    """`with FakeHubServer(mode) as hub:` — an HTTP server on 127.0.0.1 (random port) in a thread."""

    def __init__(self, mode: str = "ok") -> None:
        self.hub = FakeHub(mode=mode)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.hub))
        self.server.daemon_threads = True
        self.hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
