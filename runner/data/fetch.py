"""Hub assets: download exactly the files an experiment names, verified, at a resolved commit.

Owns: resolving a Hub revision (a branch or tag) to its 40-hex commit, listing the files a recipe
names (paths, or fnmatch patterns like huggingface_hub's allow_patterns) with the size and hash
the Hub reports, downloading each with huggingface_hub's client into a partial file that a later
fetch resumes (an HTTP Range request; xet-backed files go through hf_xet when it is installed,
whose chunk cache makes a refetch cheap, and over HTTP if hf_xet fails), checking every file against the Hub's LFS sha256 (or
git blob id for small files) before it is moved into place, refusing any listed path that would land
outside the source's folder, and the fetch record a later `runner data prepare` and `runner pin` read
(`.runner-fetch.json` in the source's folder, `.runner-fetch.<file>.json` next to a tokenizer; its
format, typed reading, per-file journal and re-verification are runner.data.fetch_record's).
Never edits recipes (runner.data.pin does), never tokenizes (runner.data.prepare does), and
never leaves a file in place that the Hub's hash does not vouch for.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get, xet_get
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils._runtime import is_xet_available

from runner.config.data_recipes import COMMIT_HEX as COMMIT
from runner.data.fetch_record import (
    RECORD_FORMAT,
    append_journal,
    identity,
    journal_path,
    read_journal,
    read_record_file,
    still_verified,
)
from runner.data.manifest import recipe_key
from runner.errors import RunnerError
from runner.fsio import atomic_write, fsync_dir

# The HTTP client whose errors the Hub client raises: httpx2 for huggingface_hub 2.x, httpx for 1.x
# (the range transformers 5.17, the GPU image's, requires). Both are supported (pyproject.toml).
_http = importlib.import_module("httpx2" if int(huggingface_hub.__version__.split(".")[0]) >= 2 else "httpx")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Asset:
    """One Hub asset an experiment needs: a tokenizer file, or a domain's raw documents."""

    name: str  # "tokenizer" or the domain
    key: str  # the resolved config key of its Hub section, for messages
    repo: str
    repo_type: str
    revision: str
    files: tuple[str, ...]
    folder: Path  # where files land (repo paths kept below it), or the tokenizer's folder
    single_file: Path | None  # a tokenizer: the one file's destination (the recipe's `path`)

    @property
    def record_path(self) -> Path:
        if self.single_file is not None:
            return self.single_file.with_name(f".runner-fetch.{self.single_file.name}.json")
        return self.folder / ".runner-fetch.json"

    def destination(self, repo_path: str) -> Path:
        return self.single_file if self.single_file is not None else self.folder / repo_path


@dataclass(frozen=True)
class FetchedFile:
    path: str  # in the repository
    local: str  # relative to the record's folder
    size: int
    sha256: str  # of the bytes on disk, checked against the Hub's
    git_oid: str  # the Hub's git blob id
    lfs: bool  # whether the Hub stores it in LFS (then `sha256` is the Hub's own)
    identity: list[int] | None = None  # [size, mtime_ns, ctime_ns, inode] once in place (fetch_record.identity)


def experiment_assets(exp) -> list[Asset]:
    """The Hub assets of a resolved experiment: its tokenizer's `hub`, each domain's `source`."""
    cfg = exp.config
    assets = []
    tok = cfg.tokenizer
    if tok.hub is not None:
        dest = exp.resolve_path(tok.path)
        assets.append(_asset("tokenizer", "tokenizer.hub", tok.hub, dest.parent, dest))
    for d, spec in cfg.mixture.domains.items():
        if spec.source is not None:
            src = spec.source
            assets.append(_asset(d, f"mixture.domains.{d}.source", src, exp.resolve_path(src.local_dir), None))
    return assets


def _asset(name: str, key: str, hub, folder: Path, single: Path | None) -> Asset:
    return Asset(name, key, hub.repo, hub.repo_type, hub.revision, tuple(hub.files), folder, single)


def read_record(asset: Asset) -> dict | None:
    """The fetch record of an asset (typed: a hand-edited one is a RunnerError naming the file and
    key), or None when it was never fetched."""
    return read_record_file(asset.record_path)


def _old_entries(asset: Asset, say=None) -> dict[str, dict]:
    """What an earlier fetch verified, by repo path: the record's files, then the journal of a fetch
    that did not finish. Only a speed-up: a file nothing vouches for is hashed in place."""
    try:
        files = (read_record(asset) or {}).get("files", [])
    except RunnerError as err:
        if say is not None:
            say(f"  {err}: ignored, the files in place are checked by their hash")
        files = []
    old = {f["path"]: f for f in files}
    old.update({f["path"]: f for f in read_journal(journal_path(asset.record_path))})
    return old


def fetched_files(exp, asset: Asset) -> tuple[dict, list[Path]]:
    """(record, local files in repo-path order) of a completed fetch that still matches the recipe
    (same repository and files; the recipe's revision, or the commit it resolved to) and the disk
    (every file present at its recorded size). Anything else names the command that fixes it."""
    file, key = recipe_key(exp, f"{asset.key}.revision")
    record = read_record(asset)
    if record is None:
        raise RunnerError(f"{asset.repo} was not fetched here: run `runner fetch` first", file=file, key=key)
    same = (record["repo"], record["repo_type"], tuple(record["patterns"])) == (
        asset.repo,
        asset.repo_type,
        asset.files,
    )
    if not same or asset.revision not in (record["revision"], record["commit"]):
        raise RunnerError(
            f"what was fetched ({record['repo']}@{record['commit'][:12]}, {', '.join(record['patterns'])}) is not "
            "what the recipe names: run `runner fetch` again",
            file=file,
            key=key,
        )
    return record, _verified_paths(asset, record, file, key)


def _verified_paths(asset: Asset, record: dict, file, key: str) -> list[Path]:
    """Each recorded file where the fetch put it, still holding the bytes it verified (identity
    unchanged, else hashed again): a changed file is named, and `runner fetch` downloads it again."""
    files = record["files"]
    if not files or (asset.single_file is not None and len(files) != 1):
        raise RunnerError(
            f"lists {len(files)} files, the fetch of {asset.repo} wrote {'one' if asset.single_file else 'some'}: "
            "run `runner fetch` again",
            file=str(asset.record_path),
            key="files",
        )
    paths = []
    for i, f in enumerate(files):
        _check_destination(asset, f["path"], str(asset.record_path), f"files[{i}].path", ": run `runner fetch` again")
        local = asset.record_path.parent / f["local"]
        if os.path.normpath(local) != os.path.normpath(asset.destination(f["path"])):
            raise RunnerError(
                f"'{f['local'][:120]}' is not where `runner fetch` puts {f['path'][:120]}: run `runner fetch` again",
                file=str(asset.record_path),
                key=f"files[{i}].local",
            )
        if not local.is_file():
            raise RunnerError(f"{local} is missing: run `runner fetch` again", file=file, key=key)
        if not still_verified(local, f):
            raise RunnerError(
                f"{local} changed since `runner fetch` verified it (its bytes no longer hash to {f['sha256'][:12]}...): "
                "run `runner fetch` again (it downloads that file again)",
                file=file,
                key=key,
            )
        paths.append(local)
    return paths


def fetch_experiment(exp, *, endpoint: str | None = None, token: str | None = None, say=print) -> list[dict]:
    """Download every Hub asset the experiment names; returns their fetch records."""
    assets = experiment_assets(exp)
    if not assets:
        raise RunnerError(
            "names no Hub asset (tokenizer.hub, mixture.domains.*.source): nothing to fetch", file=exp.path
        )
    if constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise RunnerError("HF_HUB_OFFLINE is set: `runner fetch` needs the Hub", file=exp.path)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    # every revision and file list first: a typo in the last recipe fails before any download
    plans = [_plan(api, exp, asset) for asset in assets]
    _check_space(plans)
    return [_fetch_planned(api, plan, token=token, say=say) for plan in plans]


@dataclass(frozen=True)
class _Plan:
    asset: Asset
    commit: str
    remote: list[RepoFile]
    file: Path | None  # the recipe file errors name
    key: str  # its revision key
    files_key: str


def _plan(api: HfApi, exp, asset: Asset) -> _Plan:
    """Resolve the asset's revision to a commit and list the files it names there."""
    file, key = recipe_key(exp, f"{asset.key}.revision")
    files_key = recipe_key(exp, f"{asset.key}.files")[1]
    with _hub_errors(api.endpoint, asset, file, key):
        commit = api.repo_info(asset.repo, repo_type=asset.repo_type, revision=asset.revision).sha
        if not commit or not COMMIT.match(commit):
            raise RunnerError(f"the Hub gave no commit for revision '{asset.revision}'", file=file, key=key)
        if COMMIT.match(asset.revision) and commit != asset.revision:
            raise RunnerError(f"the Hub resolved commit {asset.revision} to {commit}", file=file, key=key)
        remote = _list_files(api, asset, commit, file, files_key)
    return _Plan(asset, commit, remote, file, key, files_key)


def _fetch_planned(api: HfApi, plan: _Plan, *, token: str | None, say) -> dict:
    """Download and verify one asset's files; write its record last (what prepare and pin trust)."""
    asset, remote = plan.asset, plan.remote
    say(
        f"{asset.name}: {asset.repo} ({asset.repo_type}) '{asset.revision}' = commit {plan.commit}: "
        f"{len(remote)} file(s), {sum(r.size for r in remote):,} bytes"
    )
    old = _old_entries(asset, say)
    journal = journal_path(asset.record_path)
    asset.record_path.parent.mkdir(parents=True, exist_ok=True)
    fetched = []
    with _hub_errors(api.endpoint, asset, plan.file, plan.key):
        for i, r in enumerate(remote, 1):
            fetched.append(_fetch_file(api, plan, r, old.get(r.path), token, say=say, index=(i, len(remote))))
            append_journal(journal, asdict(fetched[-1]))  # a killed fetch resumes after this file
    record = {
        "format": RECORD_FORMAT,
        "repo": asset.repo,
        "repo_type": asset.repo_type,
        "revision": asset.revision,
        "commit": plan.commit,
        "patterns": list(asset.files),
        "files": [asdict(f) for f in fetched],
    }
    asset.record_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(asset.record_path, (json.dumps(record, indent=1) + "\n").encode())
    journal.unlink(missing_ok=True)
    return record


class _hub_errors:
    """Turns what the Hub client raises into one `file: key: message` line (exit 2)."""

    def __init__(self, endpoint: str, asset: Asset, file, key: str):
        self.endpoint, self.asset, self.file, self.key = endpoint, asset, file, key

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or isinstance(err, RunnerError):
            return False
        a = self.asset
        if isinstance(err, (_http.ConnectError, _http.TimeoutException, OfflineModeIsEnabled)):
            msg = f"cannot reach the Hub at {self.endpoint} ({type(err).__name__}: {_first_line(err)}): check the network or HF_ENDPOINT"
        elif isinstance(err, GatedRepoError):
            msg = f"{a.repo} is gated: accept its terms at {self.endpoint}/{a.repo} and set HF_TOKEN"
        elif isinstance(err, RevisionNotFoundError):
            msg = f"{a.repo} has no revision '{a.revision}'"
        elif isinstance(err, RepositoryNotFoundError):
            msg = f"no {a.repo_type} repository {a.repo} (or it is private: set HF_TOKEN)"
        elif isinstance(err, RemoteEntryNotFoundError):
            msg = f"a file is missing from {a.repo}: {_first_line(err)}"
        elif isinstance(err, (HfHubHTTPError, _http.HTTPError, OSError)):
            msg = f"download from {self.endpoint} failed: {type(err).__name__}: {_first_line(err)}"
        else:
            return False
        raise RunnerError(msg, file=self.file, key=self.key) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _list_files(api: HfApi, asset: Asset, commit: str, file, key: str) -> list[RepoFile]:
    """The repository files the recipe names, at `commit`, sorted by path (the pool's order)."""
    found: dict[str, RepoFile] = {}
    plain = [f for f in asset.files if not any(c in f for c in _GLOB_CHARS)]
    if plain:
        infos = api.get_paths_info(asset.repo, plain, revision=commit, repo_type=asset.repo_type)
        found.update({i.path: i for i in infos if isinstance(i, RepoFile) and i.path in plain})  # only what was asked
        missing = [p for p in plain if p not in found]
        if missing:
            raise RunnerError(f"not in {asset.repo} at {commit[:12]}: {', '.join(missing)}", file=file, key=key)
    for pattern in (f for f in asset.files if f not in plain):
        head = pattern[: min(pattern.find(c) for c in _GLOB_CHARS if c in pattern)]
        folder = head.rsplit("/", 1)[0] if "/" in head else None
        tree = api.list_repo_tree(
            asset.repo, path_in_repo=folder, recursive=True, revision=commit, repo_type=asset.repo_type
        )
        matched = {e.path: e for e in tree if isinstance(e, RepoFile) and fnmatch.fnmatch(e.path, pattern)}
        if not matched:
            raise RunnerError(f"'{pattern}' matches no file of {asset.repo} at {commit[:12]}", file=file, key=key)
        found.update(matched)
    if asset.single_file is not None and len(found) != 1:
        raise RunnerError(f"names {len(found)} files, a tokenizer is one", file=file, key=key)
    for path in found:  # every path, before anything is downloaded: a hostile listing writes nowhere
        _check_destination(asset, path, file, key)
    return [found[p] for p in sorted(found)]


def _check_destination(asset: Asset, repo_path: str, file, key: str, advice: str = "") -> None:
    """Refuse a repo path (as a Hub or mirror lists it) that would land outside the asset's folder:
    absolute, with `.`/`..`/empty parts, a NUL or backslash, or through a symlink below the folder
    (the folder itself may be a link, to a data disk)."""
    if asset.single_file is not None:
        return  # a tokenizer lands at the recipe's `path`, not at its repo path
    shown = repr(repo_path[:200])
    parts = repo_path.split("/")
    if repo_path.startswith("/") or any(p in ("", ".", "..") for p in parts) or any(c in repo_path for c in "\\\0"):
        raise RunnerError(
            f"{shown} would land outside {asset.folder}: refused (nothing is written or read there){advice}",
            file=file,
            key=key,
        )
    root = asset.folder.resolve()
    node = asset.folder
    for part in parts:
        node = node / part
        if node.is_symlink():
            raise RunnerError(
                f"{node} is a symlink: {shown} would be written through it, outside {asset.folder}: refused "
                "(remove the link; make local_dir itself the link to a data disk)",
                file=file,
                key=key,
            )
    if not node.resolve().is_relative_to(root):
        raise RunnerError(f"{shown} resolves outside {asset.folder}: refused", file=file, key=key)


def _expected_hash(remote: RepoFile) -> str:
    return remote.lfs.sha256 if remote.lfs is not None else remote.blob_id


def _kept(asset: Asset, remote: RepoFile, old: dict | None) -> bool:
    """The last fetch verified this very content (same git oid) and it is still in place."""
    dest = asset.destination(remote.path)
    return (
        old is not None
        and old.get("git_oid") == remote.blob_id
        and dest.is_file()
        and dest.stat().st_size == remote.size
    )


def _partial(asset: Asset, remote: RepoFile) -> Path:
    """Where a download in progress lives (named by the expected hash: never resumed into other content)."""
    dest = asset.destination(remote.path)
    return dest.with_name(f".{dest.name}.{_expected_hash(remote)[:16]}.part")


def _check_space(plans: list[_Plan]) -> None:
    """Refuse before any download what the disks cannot hold (a FineWeb-Edu sample is hundreds of GB)."""
    need: dict[int, list] = {}  # device -> [bytes, folder, first plan]
    for plan in plans:
        old = _old_entries(plan.asset)
        folder = plan.asset.folder
        while not folder.exists():
            folder = folder.parent
        entry = need.setdefault(folder.stat().st_dev, [0, folder, plan])
        for r in plan.remote:
            if not _kept(plan.asset, r, old.get(r.path)):
                part = _partial(plan.asset, r)
                entry[0] += r.size - (min(part.stat().st_size, r.size) if part.exists() else 0)
    for nbytes, folder, plan in need.values():
        free = shutil.disk_usage(folder).free
        if nbytes > free:
            raise RunnerError(
                f"the files to fetch need {nbytes:,} bytes ({nbytes / 1e9:.1f} GB) more and {folder} has "
                f"{free:,} bytes free: "
                "free space, or name fewer files",
                file=plan.file,
                key=plan.files_key,
            )


def _fetch_file(api, plan: _Plan, remote: RepoFile, old: dict | None, token, *, say, index):
    """One file: kept when the last fetch verified the same content, else downloaded (resuming a
    partial file), verified against the Hub's hash, then moved into place."""
    asset = plan.asset
    dest = asset.destination(remote.path)
    expected = _expected_hash(remote)
    local = os.path.relpath(dest, asset.record_path.parent)

    def fetched(sha256: str) -> FetchedFile:
        ident = identity(dest)
        return FetchedFile(remote.path, local, remote.size, sha256, remote.blob_id, remote.lfs is not None, ident)

    kept = _in_place(asset, remote, old, say, index)
    if kept is not None:
        return fetched(kept)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = _partial(asset, remote)
    have = part.stat().st_size if part.exists() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    say(f"  [{index[0]}/{index[1]}] {remote.path}: {remote.size:,} bytes" + (f", resuming at {have:,}" if have else ""))
    _download(api, asset, plan.commit, remote, part, have, token, say)
    sha256, git_oid = _hashes(part)
    actual = sha256 if remote.lfs is not None else git_oid
    if actual != expected:
        part.unlink()
        what = "LFS sha256" if remote.lfs is not None else "git blob id"
        raise RunnerError(
            f"{remote.path}: downloaded {remote.size:,} bytes hash to {actual}, the Hub's {what} is {expected}: "
            "refused (nothing kept, nothing recorded)",
            file=plan.file,
            key=plan.files_key,
        )
    _check_destination(asset, remote.path, plan.file, plan.files_key)  # nothing swapped in since the plan
    os.replace(part, dest)
    fsync_dir(dest.parent)
    return fetched(sha256)


def _in_place(asset: Asset, remote: RepoFile, old: dict | None, say, index) -> str | None:
    """The sha256 of the file in place when it holds the Hub's content: vouched for by an earlier
    fetch (same git oid, identity unchanged), else hashed now. None: download it."""
    dest = asset.destination(remote.path)
    at = f"  [{index[0]}/{index[1]}] {remote.path}"
    if not dest.is_file() or dest.is_symlink() or dest.stat().st_size != remote.size:
        return None
    if old is not None and old.get("git_oid") == remote.blob_id and old.get("identity") == identity(dest):
        say(f"{at}: already here, verified at fetch")
        return str(old["sha256"])
    sha256, git_oid = _hashes(dest)
    if (sha256 if remote.lfs is not None else git_oid) == _expected_hash(remote):
        say(f"{at}: already here, its hash checked again")
        return sha256
    if old is not None:
        say(f"{at}: changed since it was fetched (its bytes hash to {sha256[:12]}...): downloading it again")
    return None


def _download(api, asset: Asset, commit: str, remote: RepoFile, part: Path, have: int, token, say) -> None:
    url = hf_hub_url(asset.repo, remote.path, repo_type=asset.repo_type, revision=commit, endpoint=api.endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=api.endpoint)
    headers = build_hf_headers(token=token)
    if meta.xet_file_data is not None and is_xet_available() and not constants.HF_HUB_DISABLE_XET:
        try:  # hf_xet keeps a chunk cache under HF_HOME: a refetch after a kill reads what it already has
            xet_get(
                incomplete_path=part,
                xet_file_data=meta.xet_file_data,
                headers=headers,
                expected_size=remote.size,
                displayed_filename=remote.path,
            )
            return
        except Exception as err:  # hf_xet's own failures: the Hub serves the same bytes over HTTP
            say(f"  hf_xet failed ({_first_line(err)}): downloading {remote.path} over HTTP instead")
            part.unlink(missing_ok=True)
            have = 0
    with open(part, "ab") as f:
        http_get(
            meta.location,
            f,
            resume_size=have,
            headers=headers,
            expected_size=remote.size,
            displayed_filename=remote.path,
        )
        f.flush()
        os.fsync(f.fileno())


def _hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob id) of a file in one pass: LFS files are checked by the first, the rest by
    the second (`sha1("blob <size>\\0" + bytes)`, what the Hub reports as their oid)."""
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha256.update(block)
            sha1.update(block)
    return sha256.hexdigest(), sha1.hexdigest()
