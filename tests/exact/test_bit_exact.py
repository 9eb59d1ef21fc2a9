"""Bit-exact verification end to end, in the dtype `--dtype auto` proves first on this CPU (bfloat16 where
oneDNN has exact bfloat16 kernels, else float32) on a real pretrained target (SmolLM2-135M-Instruct, real
non-peaked logits, the real Q4_1 draft): speculative output equals `reference` (the target alone, one
position per forward) for 12 held-out chat prompts x 160 new tokens, greedy and seeded sampling at
T = 0.8, with 8 sessions at a time of mixed gamma and pipeline depth, through one `draftwire serve`, and
a third of them through the Ray pool (`serve --ray`, two replicas). With the plain kernels
(`--no-bit-exact`) the same check shows mismatches, so it is known to bite.

In plain bfloat16 about 2 % of positions flip their argmax between a one-position forward and a round's
(docs/invariance.md), so nearly every 160-token reply would differ somewhere.

The references are the cost: one forward per position, 3,840 of them (in float32 on a 2-core AVX2 EPYC
about 0.12 s each; the earlier 20 x 256 took 20 minutes there, a quarter of CI's time). They are cached
on disk, keyed by the model's bytes, the numerics, the libraries, the reference code and the spec, so
they are computed again only when one of those changes.
"""

import asyncio

import pytest
import torch

from draftwire import wire
from draftwire.contract import SamplingParams, SessionSpec
from draftwire_cli.models import smollm2
from draftwire_cli.models.prompts import chat_prompts
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tests.capability import EXACT_DTYPE
from tools.rig.serverproc import ServerProcess
from tools.testkit.oracle import cached_references
from verifier_service import invariant
from verifier_service.engine import TargetEngine

if not invariant.supported(torch.float32):
    pytest.skip("no invariant kernels on this machine (torch without oneDNN)", allow_module_level=True)
DTYPE = EXACT_DTYPE

NEW_TOKENS = 160
PROMPTS = 12
CONCURRENT = 8  # sessions in flight at a time, each with a drafter of its own
SHAPES = [(gamma, pipeline) for gamma in (2, 4, 6, 8) for pipeline in (0, 1, 2)]  # per session, in turn


@pytest.fixture(scope="module")
def pair(smollm2_pair):
    return smollm2_pair


@pytest.fixture(scope="module")
def specs(pair) -> list[SessionSpec]:
    prompts = chat_prompts(pair / smollm2.TARGET, PROMPTS)
    greedy = [SessionSpec(p, SamplingParams(), NEW_TOKENS, ignore_eos=True) for p in prompts]
    sampled = [
        SessionSpec(p, SamplingParams(temperature=0.8, seed=900 + i), NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    return greedy + sampled


@pytest.fixture(scope="module")
def references(pair, specs) -> list[list[int]]:
    """The target alone, cached by model, numerics, code and spec (tools/testkit/oracle.py): computed
    once per change to any of them, read back otherwise."""
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype=DTYPE)
    return cached_references(pair / smollm2.TARGET, engine, specs)


def speculate(address: str, draft, specs: list[SessionSpec]) -> list[list[int]]:
    """Every spec through `address`, CONCURRENT at a time on one channel, gamma and pipeline depth
    varying from session to session (so each round meets different company in the batch)."""
    drafters = [LlamaDrafter(DrafterConfig(draft, n_ctx=1024, n_threads=1)) for _ in range(CONCURRENT)]

    async def run():
        free: asyncio.Queue = asyncio.Queue()
        for drafter in drafters:
            free.put_nowait(drafter)
        async with wire.insecure_channel(address) as channel:

            async def one(i: int, spec: SessionSpec) -> list[int]:
                gamma, pipeline = SHAPES[i % len(SHAPES)]
                request = GenerationRequest(
                    spec.prompt_token_ids, spec.sampling, spec.max_new_tokens, gamma,
                    ignore_eos=True, pipeline=pipeline,
                )  # fmt: skip
                drafter = await free.get()
                try:
                    return (await EdgeSession(channel, drafter).run(request))[0]
                finally:
                    free.put_nowait(drafter)

            return await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))

    return asyncio.run(run())


def mismatches(specs, got, expected) -> list[str]:
    return [
        f"session {i} {'greedy' if spec.sampling.temperature == 0 else 'T=0.8'}: first differs at "
        f"{next(k for k, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b)}"
        for i, (spec, ids, want) in enumerate(zip(specs, got, expected, strict=True))
        if ids != want
    ]


def test_one_serve_under_concurrency_equals_the_target_alone(pair, specs, references):
    with ServerProcess(pair / smollm2.TARGET, "--dtype", DTYPE, "--max-gamma", "8") as server:
        got = speculate(server.address, smollm2.draft_path(pair), specs)
    assert all(len(ids) == NEW_TOKENS for ids in got)
    assert mismatches(specs, got, references) == []


def test_the_ray_pool_equals_the_target_alone(pair, specs, references):
    """A third of the specs (four greedy, four seeded), all eight in flight at once: the pool adds routing
    and replicas to the engine, whose batching the test above proves over all of them."""
    few, expected = specs[::3], references[::3]
    flags = ["--ray", "--replicas", "2", "--replica-cpus", "0.5", "--replica-host", "127.0.0.1"]
    with ServerProcess(pair / smollm2.TARGET, *flags, "--max-gamma", "8", timeout=300) as pool:
        got = speculate(pool.address, smollm2.draft_path(pair), few)
    assert mismatches(few, got, expected) == []


def test_without_the_invariant_kernels_outputs_differ(pair, specs):
    """The plain bfloat16 path, its own one-position reference against its own speculative output: on
    six greedy prompts at least one reply differs (each has 160 chances of a flipped near-tie)."""
    few = specs[:6]
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype=DTYPE, invariant=False)
    expected = cached_references(pair / smollm2.TARGET, engine, few)  # keyed by the plain kernels' class
    flags = ["--dtype", DTYPE, "--no-bit-exact", "--max-gamma", "8"]
    with ServerProcess(pair / smollm2.TARGET, *flags) as server:
        got = speculate(server.address, smollm2.draft_path(pair), few)
    if not mismatches(few, got, expected):
        pytest.skip(
            f"the plain {DTYPE} kernels agreed on these prompts on this CPU: the control shows nothing"
        )
