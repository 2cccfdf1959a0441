"""Session fixtures, and the rule that CI runs every test it claims to.

With the environment variable ``CI`` set (``.ci/run`` sets it), a skipped test fails, except
those marked ``gpu`` on a machine without CUDA: a missing optional dependency (``transformers``
for the Hugging Face path) must not pass CI silently. Property tests draw the same examples in
every CI run (hypothesis' ``derandomize``): CI fails for a change, not for the examples a run
happened to draw; run them locally (without ``CI``) to explore new ones.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from _toy import forget_updates_left
from _world import WorldPool
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]
SKIPS_FAIL = bool(os.environ.get("CI"))
settings.register_profile("ci", derandomize=True)
if SKIPS_FAIL:
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def worlds():
    """Run a test body on 1, 2 or 4 ranks: ``worlds.run(world_size, body, **kwargs)``."""
    pool = WorldPool()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _updates_left_forgotten() -> None:
    """Each test starts with no parameter noted as holding uncommitted updates (see
    ``forget_updates_left``)."""
    forget_updates_left()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small data file for the fine-tuning job, this package's own source: reading the
    default corpus (the standard library) costs seconds per process."""
    docs = [f.read_text() for f in sorted((REPO / "fused_optim_dist").glob("*.py"))]
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _fail_skip(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"{what} skipped, which CI does not allow (CI is set): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    expected = hasattr(report, "wasxfail") or (
        "gpu" in item.keywords and not torch.cuda.is_available()
    )
    if SKIPS_FAIL and report.skipped and not expected:
        _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if SKIPS_FAIL and report.skipped:
        _fail_skip(report, f"module {collector.nodeid}")
