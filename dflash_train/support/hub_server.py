"""A loopback Hugging Face Hub for the tests and the warm-start experiment (scripts/experiment_warm_start.py
publishes the general drafter to it): the subset of the Hub's HTTP API that `huggingface_hub` uses to create a repo,
upload a folder in one commit (preupload, LFS batch + PUT + verify, ndjson commit) and download it back (repo info,
tree, paths-info, resolve). Standard library only; state lives in memory.

    with LoopbackHub(tokens={"hf_secret"}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_secret"}
        ...  # run huggingface_hub in a subprocess with `env`
        hub.fail("POST", r"/commit/", status=500, times=2)  # inject transient errors

Run `python -m dflash_train.support.hub_server --token hf_x` to serve one by hand (HF_ENDPOINT=the printed url).

Modelled on the huggingface_hub client source (hf_api.create_repo / create_commit / _commit_api / lfs /
file_download): a file is uploaded as LFS when it matches a .gitattributes LFS pattern (as `*.safetensors` does
in the Hub's default .gitattributes), is binary, or is larger than `lfs_threshold`; everything else travels
base64-encoded inside the commit payload.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.gguf", "*.msgpack",
                    "*.npy", "*.npz", "*.parquet", "*.arrow", "*.zip", "*.tar.gz")
)
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class StoredFile:
    size: int
    oid: str  # git blob id: of the content, or of the LFS pointer
    lfs_sha256: str | None = None  # set for LFS files; their content lives in Hub.lfs_objects


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    description: str
    files: dict[str, StoredFile]
    date: str


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)


@dataclass
class Fault:
    method: str
    pattern: re.Pattern
    status: int
    remaining: int
    message: str
    echo_auth: bool  # put the request's Authorization header into the error (as a careless server might)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Hub:
    """In-memory state of the loopback Hub; `LoopbackHub` serves it over HTTP."""

    def __init__(self, tokens: set[str] | None = None, lfs_threshold: int = 10 * 1024 * 1024):
        self.tokens = set(tokens or ())
        self.lfs_threshold = lfs_threshold
        self.repos: dict[tuple[str, str], Repo] = {}
        self.blobs: dict[str, bytes] = {}  # git blob id -> content (regular files and LFS pointers)
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> content
        self.faults: list[Fault] = []
        self.requests: list[dict[str, Any]] = []  # method, path, status, authorized: what the tests can inspect
        self.lock = threading.RLock()
        self.url = ""

    # ---- test controls ----------------------------------------------------------------------------------------

    def fail(self, method: str, path_regex: str, status: int = 500, times: int = 1,
             message: str = "Internal Error - We're working hard to fix this as soon as possible!",
             echo_auth: bool = False) -> None:
        """Answer the next `times` requests whose path matches `path_regex` with `status`."""
        with self.lock:
            self.faults.append(Fault(method.upper(), re.compile(path_regex), status, times, message, echo_auth))

    def head(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> Commit:
        repo = self.repos[(repo_type, repo_id)]
        return repo.commits[self._resolve(repo, revision)]

    def file_content(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        stored = self.head(repo_id, revision, repo_type).files[path]
        return self.lfs_objects[stored.lfs_sha256] if stored.lfs_sha256 else self.blobs[stored.oid]

    def commit_count(self, repo_id: str, repo_type: str = "model") -> int:
        return len(self.repos[(repo_type, repo_id)].commits)

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _store(self, data: bytes) -> str:
        oid = git_blob_oid(data)
        self.blobs[oid] = data
        return oid

    def _new_commit(self, repo: Repo, parent: str | None, title: str, description: str,
                    files: dict[str, StoredFile]) -> Commit:
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        seed = json.dumps([repo.repo_id, parent, title, sorted((p, f.oid) for p, f in files.items()), time.time_ns()])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, title, description, files, date)
        repo.commits[commit.oid] = commit
        return commit

    def _repo(self, repo_type: str, repo_id: str, token: str | None) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and token not in self.tokens):
            raise HubError(404, f"Repository Not Found for url: {self.url}/api/{repo_type}s/{repo_id}.",
                           "RepoNotFound")
        return repo

    def _resolve(self, repo: Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if COMMIT_RE.match(revision) and revision in repo.commits:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _is_lfs(self, repo: Repo, path: str, size: int, sample: bytes, files: dict[str, StoredFile]) -> bool:
        gitattributes = files.get(".gitattributes")
        text = self.blobs[gitattributes.oid].decode() if gitattributes else ""
        patterns = [line.split()[0] for line in text.splitlines() if "filter=lfs" in line]
        name = path.rsplit("/", 1)[-1]
        by_pattern = any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path, p) for p in patterns)
        return by_pattern or size >= self.lfs_threshold or b"\x00" in sample

    @staticmethod
    def _entry(path: str, stored: StoredFile) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": stored.oid, "size": stored.size, "path": path}
        if stored.lfs_sha256:
            entry["lfs"] = {"oid": stored.lfs_sha256, "size": stored.size,
                            "pointerSize": len(lfs_pointer(stored.lfs_sha256, stored.size))}
        return entry

    @staticmethod
    def _folder(path: str) -> dict[str, Any]:
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}

    # ---- endpoints --------------------------------------------------------------------------------------------

    def create_repo(self, body: dict[str, Any], token: str | None) -> tuple[int, Any]:
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        repo_type = body.get("type") or "model"
        name, organization = body.get("name"), body.get("organization")
        if not name:
            raise HubError(400, "name is required")
        repo_id = f"{organization}/{name}" if organization else name
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.url}/{prefix}{repo_id}"
        if (repo_type, repo_id) in self.repos:
            return 409, {"error": "You already created this model repo", "url": url}
        private = body.get("visibility") == "private" or bool(body.get("private"))
        repo = Repo(repo_id, repo_type, private)
        files = {".gitattributes": StoredFile(len(DEFAULT_GITATTRIBUTES),
                                              self._store(DEFAULT_GITATTRIBUTES.encode()))}
        repo.branches["main"] = self._new_commit(repo, None, "initial commit", "", files).oid
        self.repos[(repo_type, repo_id)] = repo
        return 200, {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]}

    def repo_info(self, repo: Repo, revision: str) -> dict[str, Any]:
        commit = repo.commits[self._resolve(repo, revision)]
        return {"id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit.oid,
                "private": repo.private, "gated": False, "disabled": False, "lastModified": commit.date,
                "createdAt": commit.date, "tags": [], "downloads": 0, "likes": 0,
                "siblings": [{"rfilename": p} for p in sorted(commit.files)]}

    def create_branch(self, repo: Repo, branch: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        repo.branches[branch] = self._resolve(repo, body.get("startingPoint") or "main")
        return {}

    def preupload(self, repo: Repo, revision: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        files = repo.commits[self._resolve(repo, revision)].files
        out = []
        for item in body.get("files", []):
            sample = base64.b64decode(item.get("sample", ""))
            lfs = self._is_lfs(repo, item["path"], int(item["size"]), sample, files)
            existing = files.get(item["path"])
            remote_oid = None
            if existing is not None:
                remote_oid = existing.lfs_sha256 if lfs else existing.oid
            out.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": remote_oid})
        return {"files": out, "commitOid": repo.commits[self._resolve(repo, revision)].oid}

    def lfs_batch(self, repo: Repo, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        if body.get("operation") != "upload":
            raise HubError(400, f"unsupported LFS operation {body.get('operation')!r}")
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.url}/_lfs/upload/{oid}", "header": {}},
                    "verify": {"href": f"{self.url}/_lfs/verify", "header": {}},
                }
            objects.append(entry)
        return {"transfer": "basic", "objects": objects}

    def lfs_put(self, oid: str, data: bytes) -> dict[str, Any]:
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"LFS object content does not match its oid {oid}")
        self.lfs_objects[oid] = data
        return {}

    def lfs_verify(self, body: dict[str, Any]) -> dict[str, Any]:
        data = self.lfs_objects.get(body.get("oid", ""))
        if data is None or len(data) != int(body.get("size", -1)):
            raise HubError(404, f"LFS object {body.get('oid')} was not uploaded")
        return {"success": True}

    def commit(self, repo: Repo, revision: str, raw: bytes, token: str | None, params: dict) -> dict[str, Any]:
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        if params.get("create_pr"):
            raise HubError(400, "the loopback hub does not implement pull requests")
        if revision not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        head = repo.branches[revision]
        if header.get("parentCommit") and header["parentCommit"] != head:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(repo.commits[head].files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value["path"]
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"unsupported encoding for {path}")
                data = base64.b64decode(value["content"])
                files[path] = StoredFile(len(data), self._store(data))
            elif key == "lfsFile":
                sha = value["oid"]
                data = self.lfs_objects.get(sha)
                if data is None:
                    raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that "
                                        f"does not exist. For instance: {path}")
                if "size" in value and int(value["size"]) != len(data):
                    raise HubError(422, f"LFS size mismatch for {path}")
                files[path] = StoredFile(len(data), self._store(lfs_pointer(sha, len(data))), sha)
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                for name in [p for p in files if p.startswith(prefix)]:
                    del files[name]
            else:
                raise HubError(400, f"unknown commit operation {key!r}")
        commit = self._new_commit(repo, head, header.get("summary", ""), header.get("description", ""), files)
        repo.branches[revision] = commit.oid
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return {"success": True, "commitOid": commit.oid, "commitUrl": f"{self.url}/{prefix}{repo.repo_id}/commit/"
                f"{commit.oid}", "pullRequestUrl": None, "commitMessage": header.get("summary", "")}

    def tree(self, repo: Repo, revision: str, path: str, recursive: bool) -> list[dict[str, Any]]:
        files = repo.commits[self._resolve(repo, revision)].files
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in files):
            raise HubError(404, f"Path {path} does not exist at {revision}", "EntryNotFound")
        entries: dict[str, dict[str, Any]] = {}
        for name, stored in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            for depth in range(1, len(parts)):
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, self._folder(folder))
            if recursive or len(parts) == 1:
                entries[name] = self._entry(name, stored)
        return list(entries.values())

    def paths_info(self, repo: Repo, revision: str, paths: list[str]) -> list[dict[str, Any]]:
        files = repo.commits[self._resolve(repo, revision)].files
        out = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                out.append(self._entry(path, files[path]))
            elif any(p.startswith(path + "/") for p in files):
                out.append(self._folder(path))
        return out

    def resolve(self, repo: Repo, revision: str, path: str) -> tuple[bytes, dict[str, str]]:
        commit = repo.commits[self._resolve(repo, revision)]
        stored = commit.files.get(path)
        if stored is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{stored.oid}"'}
        if stored.lfs_sha256:
            data = self.lfs_objects[stored.lfs_sha256]
            headers["X-Linked-Etag"] = f'"{stored.lfs_sha256}"'
            headers["X-Linked-Size"] = str(len(data))
        else:
            data = self.blobs[stored.oid]
        return data, headers


API_RE = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(.*))?$")
LFS_RE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)\.git/info/lfs/objects/batch$")
RESOLVE_RE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub  # set on the subclass made by LoopbackHub

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer carries the headers of the GET, never its body
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _handle(self, method: str) -> None:
        hub = self.hub
        body = self._read_body() if method in ("POST", "PUT") else b""
        split = urlsplit(self.path)
        path, params = split.path, {k: v[-1] for k, v in parse_qs(split.query).items()}
        token = self._token()
        status = 200
        try:
            with hub.lock:
                for fault in hub.faults:
                    if fault.remaining > 0 and fault.method == method and fault.pattern.search(path):
                        fault.remaining -= 1
                        message = fault.message
                        if fault.echo_auth:
                            message += f" (request headers: Authorization: {self.headers.get('Authorization')})"
                        raise HubError(fault.status, message)
                status, payload, headers = self._route(method, path, params, body, token)
            if isinstance(payload, bytes):
                self._send(status, payload, headers, "application/octet-stream")
            else:
                self._send_json(status, payload, headers)
        except HubError as err:
            status = err.status
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send_json(err.status, {"error": err.message}, headers)
        finally:
            with hub.lock:
                hub.requests.append({"method": method, "path": path, "status": status,
                                     "authorized": token is not None and token in hub.tokens})

    def _route(self, method: str, path: str, params: dict[str, str], body: bytes,
               token: str | None) -> tuple[int, Any, dict[str, str]]:
        hub = self.hub
        if token is not None and token not in hub.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        if method == "POST" and path == "/api/repos/create":
            status, payload = hub.create_repo(json.loads(body or b"{}"), token)
            return status, payload, {}
        if method == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}, {}
        if method == "PUT" and path.startswith("/_lfs/upload/"):
            return 200, hub.lfs_put(path.rsplit("/", 1)[-1], body), {}
        if method == "POST" and path == "/_lfs/verify":
            return 200, hub.lfs_verify(json.loads(body)), {}
        if (m := LFS_RE.match(path)) and method == "POST":
            repo = hub._repo(REPO_TYPES[m.group(1)] if m.group(1) else "model", m.group(2), token)
            return 200, hub.lfs_batch(repo, json.loads(body), token), {}
        if (m := RESOLVE_RE.match(path)) and method in ("GET", "HEAD"):
            repo_type = REPO_TYPES[m.group(1)] if m.group(1) else "model"
            repo = hub._repo(repo_type, m.group(2), token)
            data, headers = hub.resolve(repo, unquote(m.group(3)), unquote(m.group(4)))
            return 200, data, headers
        if m := API_RE.match(path):
            repo = hub._repo(REPO_TYPES[m.group(1)], m.group(2), token)
            rest = [unquote(part) for part in (m.group(3) or "").split("/") if part]
            if method == "GET" and not rest:
                return 200, hub.repo_info(repo, "main"), {}
            if method == "GET" and rest[0] == "revision" and len(rest) == 2:
                return 200, hub.repo_info(repo, rest[1]), {}
            if method == "GET" and rest[0] == "tree" and len(rest) >= 2:
                recursive = params.get("recursive", "false").lower() in ("1", "true")
                return 200, hub.tree(repo, rest[1], "/".join(rest[2:]), recursive), {}
            if method == "POST" and rest[0] == "paths-info" and len(rest) == 2:
                form = parse_qs(body.decode())
                return 200, hub.paths_info(repo, rest[1], form.get("paths", [])), {}
            if method == "POST" and rest[0] == "preupload" and len(rest) == 2:
                return 200, hub.preupload(repo, rest[1], json.loads(body), token), {}
            if method == "POST" and rest[0] == "commit" and len(rest) == 2:
                return 200, hub.commit(repo, rest[1], body, token, params), {}
            if method == "POST" and rest[0] == "branch" and len(rest) == 2:
                return 200, hub.create_branch(repo, rest[1], json.loads(body or b"{}"), token), {}
        raise HubError(404, f"the loopback hub does not implement {method} {path}")

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


class LoopbackHub(Hub):
    """A `Hub` served on 127.0.0.1 at a random free port from a background thread; use as a context manager."""

    def __init__(self, tokens: set[str] | None = None, lfs_threshold: int = 10 * 1024 * 1024):
        super().__init__(tokens, lfs_threshold)
        handler = type("Handler", (_Handler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="loopback-hub", daemon=True)

    def __enter__(self) -> "LoopbackHub":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--token", action="append", default=[], help="a token the hub accepts (repeatable)")
    args = parser.parse_args()
    with LoopbackHub(tokens=set(args.token)) as hub:
        print(f"loopback hub at {hub.url} (export HF_ENDPOINT={hub.url} HF_HUB_DISABLE_XET=1); Ctrl-C stops it",
              flush=True)
        try:
            hub.thread.join()
        except KeyboardInterrupt:
            pass
