"""The fast tier's time budget is a report at the end of the run, never a failure (tests/conftest.py)."""

import concurrent.futures.process  # noqa: F401  (imported before pytester's run, which unloads what it imports)
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).parents[1] / "conftest.py"


def test_a_fast_test_over_its_budget_passes_and_is_reported(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    tests = pytester.mkdir("tests")
    tests.joinpath("conftest.py").write_text("")
    unit = tests / "unit"
    unit.mkdir()
    unit.joinpath("test_slow.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(0.2)\n\ndef test_quick():\n    pass\n"
    )
    result = pytester.runpytest("--fast-budget-s=0.05", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*fast tier: 1 test phases over the 0.05 s budget (a report)*", "*call*test_slow*"]
    )
