"""Skips for what this machine lacks, each naming what is missing (a CPU feature, a fetched pair), and
the dtype exact mode runs here."""

import os

import pytest
import torch

from verifier_service import invariant
from verifier_service.numerics import Hardware, bf16_refusal

BF16 = invariant.supported(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(not BF16, reason=bf16_refusal(Hardware.detect("cpu")) if not BF16 else "")
# The dtype `--dtype auto` proves first on this CPU: bfloat16 where oneDNN has it, else float32.
EXACT_DTYPE = "bfloat16" if BF16 else "float32"


def dtype_params(*dtypes):
    """pytest params of dtypes (torch dtypes or names), bfloat16 skipped where the CPU lacks it."""
    return [
        pytest.param(d, marks=needs_bf16, id=str(d)) if "bfloat16" in str(d) else pytest.param(d, id=str(d))
        for d in dtypes
    ]


def fetched(name: str):
    """The directory of a pair `draftwire models fetch NAME` assembles (draftwire_cli/models/pairs.py). Skips
    where it has not been fetched; fails instead where DRAFTWIRE_FETCHED=required (CI fetches them)."""
    from draftwire_cli.models import chunks
    from draftwire_cli.models.pairs import PAIRS

    pair = PAIRS[name]
    directory = chunks.default_dir(pair)
    if not chunks.is_fetched(pair, directory):
        why = f"no fetched {name} pair in {directory}: `draftwire models fetch {name}` ({pair.download_note})"
        if os.environ.get("DRAFTWIRE_FETCHED") == "required":
            pytest.fail(why)
        pytest.skip(why)
    return directory
