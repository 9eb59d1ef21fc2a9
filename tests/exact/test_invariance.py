"""Invariant mode on a real pretrained target (SmolLM2-135M-Instruct, real non-peaked logits): a position's
logits are bitwise the same computed alone, inside a gamma + 1 forward, and inside a ragged batch of
sessions, in float32 and bfloat16; and the plain path is not (so these tests are known to bite)."""

from itertools import pairwise

import pytest
import torch

from draftwire_cli.models import smollm2
from draftwire_cli.models.prompts import chat_turns
from tests.capability import dtype_params, needs_bf16
from verifier_service import invariant
from verifier_service.engine import Forward, TargetEngine

if not invariant.supported(torch.float32):
    pytest.skip("no invariant kernels on this machine", allow_module_level=True)

QUESTIONS = ["Name a fruit that is yellow.", "Write a haiku about rain.", "What is 3 + 4?"]
NEW = [17, 2038, 314, 4000, 7, 99, 1200, 3001, 12]  # nine tokens to run after each prompt


@pytest.fixture(scope="module")
def pair(smollm2_pair):
    return smollm2_pair


@pytest.fixture(scope="module")
def prompts(pair):
    return chat_turns(pair / smollm2.TARGET, QUESTIONS)


def one_at_a_time(engine, key, prompt):
    """# [9, vocab]: each new position in a forward of its own."""
    engine.forward(key, 0, prompt, wants_logits=False)
    return torch.cat([engine.forward(key, len(prompt) + i, [t]) for i, t in enumerate(NEW)])


def together(engine, prompts, widths):
    """Each prompt's first `width` new positions in one ragged batch.  # per prompt [width, vocab]"""
    keys = [f"b{i}" for i in range(len(prompts))]
    engine.forward_many(
        [Forward(k, 0, tuple(p), wants_logits=False) for k, p in zip(keys, prompts, strict=True)]
    )
    forwards = [Forward(k, len(p), tuple(NEW[:w])) for k, p, w in zip(keys, prompts, widths, strict=True)]
    return engine.forward_many(forwards)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "blocks"])
@pytest.mark.parametrize("dtype", dtype_params("float32", "bfloat16"))
def test_invariant_logits_do_not_depend_on_what_shares_the_forward(pair, prompts, dtype, fused):
    """On either attention of a CPU: torch's fused kernel in whole blocks (where the load proved it, as
    here) and our own key blocks."""
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype=dtype)
    if fused and not engine.fused_attention:
        pytest.skip("the load found torch's fused attention not invariant on this machine")
    engine.fused_attention = fused
    alone = [one_at_a_time(engine, f"a{i}", p) for i, p in enumerate(prompts)]
    nine = together(engine, prompts[:1], [9])[0]
    assert torch.equal(nine, alone[0])  # a round of gamma + 1 = 9 positions
    for rows, expected in zip(together(engine, prompts, [5, 1, 9]), alone, strict=True):
        assert torch.equal(rows, expected[: rows.shape[0]])  # a ragged batch of three sessions


@needs_bf16
def test_the_plain_bfloat16_path_is_not_invariant(pair, prompts):
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype="bfloat16", invariant=False)
    alone = one_at_a_time(engine, "a", prompts[0])
    nine = together(engine, prompts[:1], [9])[0]
    if torch.equal(nine, alone):
        pytest.skip("the plain bfloat16 kernels happen to agree on this CPU: the control shows nothing here")


@pytest.mark.parametrize("dtype", dtype_params("float32", "bfloat16"))
def test_a_batch_whose_attention_runs_in_one_set_of_calls_gives_each_row_its_bits_alone(pair, prompts, dtype):
    """A GPU's path (engine.batched_attention: every session of a layer in one set of attention calls,
    attention.batched_block_attention), forced on this CPU, whose own path is one session at a time:
    each position of a ragged batch, prompts prefilled that way too, has the bits it has alone."""
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype=dtype)
    assert not engine.batched_attention  # a CPU's choice
    engine.fused_attention = False  # the key blocks alone, whose bits the batched calls give
    alone = [one_at_a_time(engine, f"a{i}", p) for i, p in enumerate(prompts)]
    engine.batched_attention = True
    for rows, expected in zip(together(engine, prompts, [5, 1, 9]), alone, strict=True):
        assert torch.equal(rows, expected[: rows.shape[0]])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "blocks"])
@pytest.mark.parametrize("dtype", dtype_params("float32", "bfloat16"))
def test_a_long_prompt_in_one_forward_gives_each_position_its_bits_in_pieces(pair, prompts, dtype, fused):
    """A prompt of 900 positions prefilled in one forward (past attention.CAUSAL_MIN, which the fused
    kernel takes as one causal call, and past the whole linear calls' 512 rows) gives every position the
    logits it gets when the same prompt runs in pieces after a cache: a chunk of 300, a round, one
    position, a chunk of 161 (past one fused call's rows), then the rest."""
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype=dtype)
    if fused and not engine.fused_attention:
        pytest.skip("the load found torch's fused attention not invariant on this machine")
    engine.fused_attention = fused
    prompt = (prompts[0] + prompts[1] + prompts[2]) * 40
    prompt = prompt[:900]
    assert len(prompt) == 900
    whole = engine.forward("whole", 0, prompt)
    edges = [0, 300, 305, 306, 467, 900]
    pieces = torch.cat([engine.forward("pieces", a, prompt[a:b]) for a, b in pairwise(edges)])
    assert torch.equal(whole, pieces)
