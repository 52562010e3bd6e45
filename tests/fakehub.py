"""A loopback server speaking the part of the Hugging Face Hub's HTTP API that `runner fetch` calls
through the real `huggingface_hub` client (point HF_ENDPOINT at `FakeHub.url`):

- GET  /api/{models|datasets}/{repo}/revision/{rev}       repo info: `sha` is the resolved commit
- POST /api/{models|datasets}/{repo}/paths-info/{rev}     size, git oid, LFS sha256 of named paths
- GET  /api/{models|datasets}/{repo}/tree/{rev}[/{path}]  recursive listing (glob patterns)
- HEAD/GET /[datasets/]{repo}/resolve/{rev}/{path}        X-Repo-Commit, ETag / X-Linked-Etag /
                                                           X-Linked-Size, Range requests (206)

and the part `runner export --push` writes through (`HfApi.create_repo`, `create_branch`,
`upload_folder`, `delete_branch`, `list_repo_refs`); every write needs a bearer token of `tokens`:

- POST   /api/repos/create                                  a repository (409 when it exists)
- POST   /api/validate-yaml                                 a model card's front matter (accepted)
- POST|DELETE /api/{models|datasets}/{repo}/branch/{name}   a branch from main's head (409 when it exists)
- POST   /api/{models|datasets}/{repo}/preupload/{rev}      every file uploaded inline ("regular")
- POST   /api/{models|datasets}/{repo}/commit/{rev}         NDJSON: the header, then base64 files
- GET    /api/{models|datasets}/{repo}/refs                 branches and their commits

Errors carry the Hub's X-Error-Code header (RepoNotFound, RevisionNotFound, EntryNotFound), which
is how the client tells them apart. A repository's files are all LFS files (the Hub reports their
sha256, as for FineWeb-Edu's parquet shards) or all plain git blobs (a sha1 oid only, as for a
tokenizer.json under 10 MB). Faults for tests: `stall_after[path] = n` serves n bytes of a file then
holds the connection; `lie_sha256.add(path)` reports a wrong LFS sha256; `xet.add(path)` announces
a file as xet-backed, whose xet token route (not served here) then fails; `hostile[path] = bytes`
lists (and serves) an entry in every tree listing whatever folder is asked, as a hostile Hub or
mirror would (`sample/../../../x.parquet`, an absolute path); `refuse_writes` answers every write 403 (a token without write access); `fail_commits` refuses commits (400).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        #: (repo_type, repo_id) -> {"lfs": bool, "refs": {branch: commit}, "commits": {commit: {path: bytes}}}
        self.repos: dict[tuple[str, str], dict] = {}
        self.stall_after: dict[str, int] = {}
        self.lie_sha256: set[str] = set()
        self.xet: set[str] = set()  # paths announced as xet-backed (whose xet token route then fails)
        self.hostile: dict[str, bytes] = {}  # listed in every tree answer, served at any commit
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.tokens: set[str] = set()  # bearer tokens that may write
        self.refuse_writes = False
        self.fail_commits = False
        self.commit_messages: list[str] = []
        self._release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(
        self, repo_type: str, repo_id: str, files: dict[str, bytes], *, lfs: bool, branch: str = "main"
    ) -> str:
        """A new commit holding `files` at the head of `branch`; returns its 40-hex id."""
        commit = hashlib.sha1(repr(sorted(files.items())).encode() + repo_id.encode()).hexdigest()
        repo = self.repos.setdefault((repo_type, repo_id), {"lfs": lfs, "refs": {}, "commits": {}})
        repo["commits"][commit] = dict(files)
        repo["refs"][branch] = commit
        return commit

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._release.set()  # a stalled download ends
        self._server.shutdown()
        self._server.server_close()

    # ---- what the handler asks -----------------------------------------------------------------

    def lookup(self, repo_type: str, repo_id: str, rev: str):
        """(commit, files, lfs) or an error code."""
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            return "RepoNotFound"
        commit = repo["refs"].get(rev, rev)
        if commit not in repo["commits"]:
            return "RevisionNotFound"
        return commit, {**repo["commits"][commit], **self.hostile}, repo["lfs"]

    def entry(self, path: str, data: bytes, lfs: bool) -> dict:
        out = {"type": "file", "path": path, "size": len(data), "oid": git_oid(data)}
        if lfs:
            sha = hashlib.sha256(data).hexdigest()
            out["lfs"] = {"oid": "0" * 64 if path in self.lie_sha256 else sha, "size": len(data), "pointerSize": 134}
        return out


_WRITE = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/(branch|preupload|commit)/([^/]+)$")
_REFS = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/refs$")
_API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/(revision|paths-info|tree)/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/(?:(datasets)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: tests read hub.requests instead
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, code: str, status: int = 404, head: bool = False) -> None:
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, head=head)

        def _json(self, obj) -> None:
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _may_write(self) -> bool:
            auth = self.headers.get("Authorization") or ""
            if auth.removeprefix("Bearer ") not in hub.tokens:
                self._body()
                self._send(401, b'{"error": "Invalid credentials in Authorization header"}')
                return False
            if hub.refuse_writes:
                self._body()
                self._send(403, b'{"error": "You don\'t have the rights to write to this repository"}')
                return False
            return True

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            hub.requests.append((method, url.path, self.headers.get("Range")))
            write, refs = _WRITE.match(url.path), _REFS.match(url.path)
            if url.path == "/api/validate-yaml" and method == "POST":
                self._body()
                self._json({"errors": [], "warnings": []})
                return
            if url.path == "/api/repos/create" and method == "POST":
                if self._may_write():
                    self._create_repo(json.loads(self._body()))
                return
            if refs and method == "GET":
                self._refs(refs.group(1)[:-1], refs.group(2))
                return
            if write and method in ("POST", "DELETE"):
                if self._may_write():
                    repo_type, repo_id, what, name = write.groups()
                    self._write(repo_type[:-1], repo_id, what, unquote(name), method)
                return
            api, resolve = _API.match(url.path), _RESOLVE.match(url.path)
            if api and method in ("GET", "POST"):
                repo_type, repo_id, what, rev, path = api.groups()
                self._api(repo_type[:-1], repo_id, what, unquote(rev), unquote(path or ""))
            elif resolve and method in ("GET", "HEAD"):
                repo_type, repo_id, rev, path = resolve.groups()
                self._resolve(repo_type[:-1] if repo_type else "model", repo_id, unquote(rev), unquote(path), method)
            else:
                self._send(404, b"not found")

        def _api(self, repo_type: str, repo_id: str, what: str, rev: str, path: str) -> None:
            found = hub.lookup(repo_type, repo_id, rev)
            if isinstance(found, str):
                self._error(found)
                return
            commit, files, lfs = found
            if what == "revision":
                self._json({"id": repo_id, "sha": commit, "siblings": [{"rfilename": p} for p in sorted(files)]})
            elif what == "paths-info":
                asked = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()).get("paths", [])
                self._json([hub.entry(p, files[p], lfs) for p in asked if p in files])
            else:  # tree, always listed recursively here
                prefix = f"{path}/" if path else ""
                listing = [hub.entry(p, d, lfs) for p, d in sorted(files.items()) if p.startswith(prefix)]
                listing += [hub.entry(p, d, lfs) for p, d in hub.hostile.items() if not p.startswith(prefix)]
                folders = {p.rsplit("/", 1)[0] for p in files if p.startswith(prefix) and "/" in p[len(prefix) :]}
                self._json(listing + [{"type": "directory", "path": f, "oid": "0" * 40} for f in sorted(folders)])

        def _resolve(self, repo_type: str, repo_id: str, rev: str, path: str, method: str) -> None:
            head = method == "HEAD"
            found = hub.lookup(repo_type, repo_id, rev)
            if isinstance(found, str) or path not in found[1]:
                self._error(found if isinstance(found, str) else "EntryNotFound", head=head)
                return
            commit, files, lfs = found
            data = files[path]
            e = hub.entry(path, data, lfs)
            headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes", "ETag": f'"{e["oid"]}"'}
            if lfs:
                headers.update({"X-Linked-Etag": f'"{e["lfs"]["oid"]}"', "X-Linked-Size": len(data)})
            if path in hub.xet:
                refresh = f"{hub.url}/api/{repo_type}s/{repo_id}/xet-read-token/{commit}"
                headers.update({"X-Xet-Hash": "ab" * 32, "X-Xet-Refresh-Route": refresh})
            rng = None if head else re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
            start = int(rng.group(1)) if rng else 0
            if rng:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            stall = hub.stall_after.get(path)
            if head or stall is None:
                self._send(206 if start else 200, body, headers, head=head)
                return
            self.send_response(206 if start else 200)
            for k, v in {**headers, "Content-Length": len(body)}.items():
                self.send_header(k, str(v))
            self.end_headers()
            self.wfile.write(body[: max(0, stall - start)])
            self.wfile.flush()
            hub._release.wait()  # hold the connection open: the client waits until it is killed

        def _create_repo(self, payload: dict) -> None:
            repo_id = f"{payload.get('organization')}/{payload['name']}"
            key = (payload.get("type") or "model", repo_id)
            if key in hub.repos:
                body = {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"}
                self._send(409, json.dumps(body).encode(), {"Content-Type": "application/json"})
                return
            hub.add_repo(
                key[0], repo_id, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, lfs=False
            )
            hub.repos[key]["private"] = payload.get("visibility") == "private"
            self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def _refs(self, repo_type: str, repo_id: str) -> None:
            repo = hub.repos.get((repo_type, repo_id))
            if repo is None:
                self._error("RepoNotFound")
                return
            branches = [
                {"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in sorted(repo["refs"].items())
            ]
            self._json({"branches": branches, "tags": [], "converts": []})

        def _write(self, repo_type: str, repo_id: str, what: str, name: str, method: str) -> None:
            body = self._body()
            repo = hub.repos.get((repo_type, repo_id))
            if repo is None:
                self._error("RepoNotFound")
                return
            if what == "branch" and method == "DELETE":
                if repo["refs"].pop(name, None) is None:
                    self._error("RevisionNotFound")
                else:
                    self._json({})
            elif what == "branch":
                if name in repo["refs"]:
                    self._send(409, b'{"error": "Reference already exists"}')
                    return
                start = (json.loads(body) if body else {}).get("startingPoint") or "main"
                repo["refs"][name] = repo["refs"].get(start, start)
                self._json({})
            elif what == "preupload":
                files = json.loads(body)["files"]
                self._json(
                    {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                )
            elif hub.fail_commits:  # 400, not 500: the client retries a 500 with back-off for ~20 s
                self._send(400, b'{"error": "Commit refused"}')
            else:
                self._commit(repo, repo_id, name, [json.loads(line) for line in body.splitlines() if line.strip()])

        def _commit(self, repo: dict, repo_id: str, branch: str, items: list[dict]) -> None:
            if branch not in repo["refs"]:
                self._error("RevisionNotFound")
                return
            files = dict(repo["commits"][repo["refs"][branch]])
            for item in items:
                value = item["value"]
                if item["key"] == "header":
                    hub.commit_messages.append(value["summary"])
                elif item["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "deletedFile":
                    files.pop(value["path"], None)
            commit = hashlib.sha1(repr(sorted(files.items())).encode() + repo_id.encode() + branch.encode()).hexdigest()
            repo["commits"][commit] = files
            repo["refs"][branch] = commit
            self._json(
                {"commitUrl": f"{hub.url}/{repo_id}/commit/{commit}", "commitOid": commit, "pullRequestUrl": None}
            )

        def do_DELETE(self) -> None:
            self._route("DELETE")

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler
