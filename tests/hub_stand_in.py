"""A localhost stand-in for the Hugging Face Hub: the real Hub cannot be reached here, so tests run
huggingface_hub itself, unmodified, against this server (HF_ENDPOINT=http://127.0.0.1:PORT).

It serves the file endpoint (`/{org}/{name}/resolve/{revision}/{file}`, with the Hub's error headers) and
the calls a release upload makes: create a repo, create a branch, validate the card's YAML, preupload and
commit (the NDJSON body `upload_folder` sends). Preupload answers "regular" for every file, so contents travel inside the commit
instead of through LFS; the client follows whatever mode the server names. Uploaded commits are served
by the file endpoint, so a test can push a release and load it back.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import unquote

import pytest
import yaml

#: A repo's uploaded state: branch -> (commit hash, {path: bytes}).
Branches = dict[str, tuple[str, dict[str, bytes]]]


class HubServer(BaseHTTPRequestHandler):
    """Request handler; tests set the class attributes (one server per test)."""

    repos: ClassVar[dict[str, dict[str, bytes]]] = {}  # download-only repos: files on main at `commit`
    commit = "c0ffee" * 6 + "c0ff"
    requests: ClassVar[list[tuple[str, str | None]]] = []  # (path, Authorization header) of file requests
    uploaded: ClassVar[dict[str, Branches]] = {}  # repos created through the API
    commits: ClassVar[list[dict]] = []  # every commit received: repo, branch, summary, files

    @classmethod
    def reset(cls, repos: dict[str, dict[str, bytes]] | None = None) -> None:
        """Start a test from a Hub that holds only `repos`."""
        cls.repos, cls.requests, cls.uploaded, cls.commits = dict(repos or {}), [], {}, []

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":  # other Hub APIs the client may call are not served
            return self._error(404, "EntryNotFound")
        self.requests.append((self.path, self.headers.get("Authorization")))
        org, name, _, revision, *file = parts
        repo = f"{org}/{name}"
        if repo == "lidarverse/gated":
            return self._error(403, "GatedRepo")
        found = self._revision(repo, unquote(revision))
        if isinstance(found, str):
            return self._error(404, found)
        commit, files = found
        data = files.get("/".join(file))
        if data is None:
            return self._error(404, "EntryNotFound")
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _revision(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | str:
        """(commit, files) a branch name or commit hash names in `repo`, or the Hub's error code."""
        branches = self.uploaded.get(repo)
        if branches is not None:
            for branch, (commit, files) in branches.items():
                if revision in (branch, commit):
                    return commit, files
            return "RevisionNotFound"
        files = self.repos.get(repo)
        if files is None:
            return "RepoNotFound"
        if revision not in ("main", self.commit):
            return "RevisionNotFound"
        return self.commit, files

    # ---------------------------------------------------------------- uploads

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        self.requests.append((f"POST {path}", self.headers.get("Authorization")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts == ["api", "repos", "create"]:
            return self._create_repo(json.loads(body))
        if parts == ["api", "validate-yaml"]:
            return self._validate_yaml(json.loads(body)["content"])
        if len(parts) == 6 and parts[:2] == ["api", "models"]:
            repo, action, revision = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            if repo not in self.uploaded:
                return self._error(404, "RepoNotFound")
            if action == "branch":
                return self._create_branch(repo, revision, json.loads(body or b"{}"))
            if action == "preupload":
                return self._preupload(repo, revision, json.loads(body))
            if action == "commit":
                return self._commit(repo, revision, body)
        return self._error(404, "EntryNotFound")

    def _create_repo(self, payload: dict) -> None:
        repo = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = f"http://{self.headers['Host']}/{repo}"
        if repo in self.uploaded or repo in self.repos:
            return self._json(409, {"error": "You already created this model repo", "url": url})
        initial = hashlib.sha1(f"initial {repo}".encode()).hexdigest()
        self.uploaded[repo] = {"main": (initial, {".gitattributes": b"*.safetensors filter=lfs\n"})}
        self._json(200, {"url": url})

    def _validate_yaml(self, card: str) -> None:
        """The check the Hub runs on a README.md before a commit: its front matter must be a YAML mapping."""
        match = re.match(r"^---\n(.*?)\n---\n", card, re.DOTALL)
        if match is None:
            return self._json(200, {"errors": [], "warnings": [{"message": "Empty or missing yaml metadata"}]})
        try:
            metadata = yaml.safe_load(match[1])
        except yaml.YAMLError as e:
            return self._json(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
        if not isinstance(metadata, dict):
            return self._json(400, {"errors": [{"message": "the metadata must be a YAML mapping"}]})
        self._json(200, {"errors": [], "warnings": []})

    def _create_branch(self, repo: str, branch: str, payload: dict) -> None:
        branches = self.uploaded[repo]
        if branch in branches:
            return self._json(409, {"error": f"Branch {branch} already exists"})
        start = self._revision(repo, payload.get("startingPoint", "main"))
        if isinstance(start, str):
            return self._error(404, start)
        branches[branch] = (start[0], dict(start[1]))
        self._json(200, {})

    def _preupload(self, repo: str, revision: str, payload: dict) -> None:
        if revision not in self.uploaded[repo]:
            return self._error(404, "RevisionNotFound")
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in payload["files"]]
        self._json(200, {"files": files})

    def _commit(self, repo: str, branch: str, body: bytes) -> None:
        """Apply an NDJSON commit (a header line, then one line per added file) to `branch`."""
        branches = self.uploaded[repo]
        if branch not in branches:
            return self._error(404, "RevisionNotFound")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        added = {
            line["value"]["path"]: base64.b64decode(line["value"]["content"])
            for line in lines
            if line["key"] == "file"
        }
        parent, files = branches[branch]
        commit = hashlib.sha1(parent.encode() + json.dumps(sorted(added)).encode() + b"".join(added.values()))
        branches[branch] = (commit.hexdigest(), {**files, **added})
        self.commits.append({"repo": repo, "branch": branch, "summary": header["summary"], "files": added})
        host = f"http://{self.headers['Host']}"
        self._json(200, {"commitUrl": f"{host}/{repo}/commit/{commit.hexdigest()}", "commitOid": commit.hexdigest()})

    # ---------------------------------------------------------------- replies

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def serve_hub(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Iterator[str]:
    """Run the stand-in on a free port and point huggingface_hub at it (endpoint, cache, token from the
    environment); yields the endpoint URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    try:
        yield endpoint
    finally:
        server.shutdown()
        server.server_close()
