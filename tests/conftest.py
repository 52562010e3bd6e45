"""Fixtures shared by several test files: a copy of the repository's recipes and experiments."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from suitetimes import SuiteTimes

REPO = Path(__file__).resolve().parents[1]

# One torch thread per test process, set before torch is imported: pytest -n's workers already share
# the cores, and two threads each on a shared 2-core machine ran 2.8x slower (bench/bench_threads.py);
# launches in a process of their own inherit it (trainfixtures.env sets it too), as does the default
# hardware.threads: 1. A run that asks for more sets it itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _runner_cache(tmp_path: Path, monkeypatch) -> None:
    """Each test its own shard-verification cache (launches inherit it), never the user's ~/.cache."""
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "runner-cache"))


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A copy of the repo's recipes and experiments, plus the built-in tokenizer they pin."""
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    shutil.copytree(REPO / "experiments", tmp_path / "experiments")
    tok = tmp_path / "runner/builtin/assets/tokenizer.json"
    tok.parent.mkdir(parents=True)
    shutil.copy(REPO / "runner/builtin/assets/tokenizer.json", tok)
    return tmp_path


@pytest.fixture()
def project_with_data(project: Path) -> Path:
    """`project` plus the built-in corpus, built as `runner data builtin` does."""
    from runner.data.builtin.build import build_builtin

    build_builtin(project / "data/builtin")
    return project


@pytest.fixture(scope="module")
def template_store(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, made once: creating one (its schema migrations) takes seconds."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "template.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture()
def store(template_store):
    """`store(path)`: an empty MLflow store at `path` (a copy of the template); returns its URI."""

    def make(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(template_store, path)
        return f"sqlite:///{path}"

    return make


def pytest_configure(config) -> None:
    """The suite's wall time, its slowest files and CI's time budget (tests/suitetimes.py), in the
    process that reports (not in pytest -n's workers)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteTimes(), "suitetimes")


#: test files whose module fixtures cost more than the fast subset's 2 minutes carry: every test of
#: one is `slow` (tests/export/test_export.py: a trained, scored and exported run and its fp32 export,
#: ~18 s per worker), and its quick ones also `device_subset`, which keeps them in .ci/run's
#: device-version subset (`-m "not slow or device_subset"`)
HEAVY_FIXTURE_MODULES = ("tests/export/test_export.py",)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config, items) -> None:
    """The tests of HEAVY_FIXTURE_MODULES marked as said there; then the longest tests first, then
    the other slow ones, then the rest (a stable sort): parallel workers (pytest -n) start the
    minutes-long tests at once and end together on short ones."""
    for item in items:
        if item.nodeid.split("::")[0] in HEAVY_FIXTURE_MODULES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.device_subset)

    def rank(item) -> tuple[int, float]:
        longest = item.get_closest_marker("longest")
        if longest is not None:
            return 0, -float(longest.args[0] if longest.args else 1)  # its minutes, longest first
        return (1 if item.get_closest_marker("slow") else 2), 0.0

    items.sort(key=rank)
