"""`runner export ... --push REPO`: an exported folder to a Hub repository, one commit on its own branch.

Owns: the branch a checkpoint goes to (`step-0001200-exposure-2457600`: its step and its exact
exposure tokens from its own ledger, never step x batch), the one commit per export
(`upload_folder`), removing a branch this push created when its commit failed (no branch is left
looking complete without its files), and turning what the Hub client raises into one line (a
missing token, a refused write, an unreachable Hub, a repository id the Hub would refuse).
huggingface_hub 1.x and 2.x: only calls both have (`HfApi.create_repo/list_repo_refs/create_branch/
upload_folder/delete_branch`, `get_token`, `validate_repo_id`).
`HF_TOKEN` and `HF_ENDPOINT` as the client reads them. Never pushes a folder that was not verified
(runner.export.export calls it after the move into place).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from runner.errors import RunnerError


@dataclass
class Pushed:
    repo: str
    branch: str
    commit: str
    url: str


def branch_name(step: int, exposure_tokens: int) -> str:
    """`step-0001200-exposure-2457600`: sortable by step, exact in tokens."""
    return f"step-{step:07d}-exposure-{exposure_tokens}"


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection and timeout errors of whichever HTTP client this huggingface_hub uses (httpx2 in 2.x, httpx in 1.x)."""
    found: list[type[BaseException]] = []
    for name in ("httpx2", "httpx"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found += [module.ConnectError, module.TimeoutException]
    return tuple(found)


def _one_line(err: BaseException, endpoint: str, repo: str) -> str | None:
    if isinstance(err, _transport_errors()):
        return f"cannot reach the Hub at {endpoint} ({type(err).__name__}): check the network or HF_ENDPOINT"
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            return f"the Hub at {endpoint} refused the token (401): set HF_TOKEN to a valid token"
        if status == 403:
            return f"the Hub refused the push (403): the token may not write to {repo}"
        if isinstance(err, RepositoryNotFoundError):
            return f"no repository {repo} at {endpoint}, and it could not be created"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"push to {endpoint} failed ({status}): {first}"
    if isinstance(err, OSError):
        return f"push to {endpoint} failed: {err}"
    return None


def check_repo_id(repo: str) -> None:
    """A repository id the Hub accepts (huggingface_hub's own rule), checked before an export of
    minutes: a push that cannot be named is refused now."""
    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "not a repository id"
        first = first.split(" Use `repo_type`")[0]  # the Python API's advice, not the command's
        raise RunnerError(f"not a Hub repository id: {first}", key="--push") from None


def check_token() -> str:
    """The Hub token huggingface_hub finds (HF_TOKEN, or a saved login); refused when there is none."""
    token = get_token()
    if not token:
        raise RunnerError(
            "no Hugging Face token: set HF_TOKEN to a token that may write to the repository", key="--push"
        )
    return token


def push_folder(
    folder: Path, repo: str, *, step: int, exposure_tokens: int, revision: str | None = None, private: bool = False
) -> Pushed:
    """One commit of every file of `folder` to `repo` on `revision` (default: the checkpoint's branch)."""
    token = get_token()
    if not token:
        raise RunnerError(
            "no Hugging Face token: set HF_TOKEN to a token that may write to the repository", key="--push"
        )
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    branch = revision or branch_name(step, exposure_tokens)
    state = "not created"  # then "unchanged" (it was there) or "created" (by this push)
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        state = "unchanged"
        if branch not in {b.name for b in api.list_repo_refs(repo).branches}:
            api.create_branch(repo, branch=branch)
            state = "created"
        info = api.upload_folder(
            repo_id=repo,
            folder_path=str(folder),
            revision=branch,
            commit_message=f"runner export: step {step:,}, exposure {exposure_tokens:,} tokens",
        )
    except Exception as err:
        line = _one_line(err, endpoint, repo)
        if line is None:
            raise
        raise RunnerError(line + f"; branch {branch} {_undo(api, repo, branch, state)}", key="--push") from None
    return Pushed(repo, branch, str(info.oid), f"{endpoint}/{repo}/tree/{branch}")


def _undo(api: HfApi, repo: str, branch: str, state: str) -> str:
    """Remove the branch this push created (a branch without its commit would look like an export
    that is not there); what became of it, for the error line."""
    if state != "created":
        return state
    try:
        api.delete_branch(repo, branch=branch)
    except Exception as err:  # the push's own error is the one to raise; this one is said beside it
        return f"NOT removed ({type(err).__name__}): delete it by hand"
    return "removed"
