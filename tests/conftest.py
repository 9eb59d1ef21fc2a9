"""Shared fixtures: a small model pair built from local data, and a real verifier on a loopback port."""

import os

# Nothing in the tests may reach a model hub; fail loudly instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402

from tools.models.kit import TestPair, build_test_pair  # noqa: E402
from tools.testkit.serverproc import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def test_pair(tmp_path_factory) -> TestPair:
    return build_test_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def smollm2_pair():
    """The SmolLM2 pair in its default place (install.sh fetched it; fetching again is a no-op)."""
    import importlib.metadata

    from tools.models import smollm2

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
