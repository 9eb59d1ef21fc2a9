"""Structured output under speculation: a constrained session's tokens over real gRPC equal the target's
alone under the same constraint, greedy and seeded, at several γ and pipeline depths, batched, thin.

Greedy output is compared with transformers' own `generate` whose logits processor applies llguidance's
mask from transformers' tokenizer (nothing of ours: no engine, no rules, no matcher); seeded output with
`reference` (invariance, as in test_exactness). The pair is the committed demo pair (a trained target and
its draft), served by `draftwire serve` in a subprocess in float32; the drafts are real llama.cpp.
"""

import asyncio
import json
import time

import grpc
import numpy as np
import pytest
from transformers import AutoTokenizer

from draftwire import wire
from draftwire.contract import Constraint, ConstraintKind, Drafting, SamplingParams, SessionSpec
from draftwire.grammar import compile_constraint
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.models.demopair.files import DEFAULT_OUT, PairFiles
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import ServerProcess
from tools.testkit.edge import run_requests as speculate
from tools.testkit.oracle import transformers_constrained_greedy
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

FILES = PairFiles(DEFAULT_OUT)
NEW_TOKENS = 40
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_object": Constraint(ConstraintKind.JSON_OBJECT),
    "json_schema": Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON)),
    "grammar": Constraint(ConstraintKind.GRAMMAR, 'start: "def " NAME "(" NAME "):"\nNAME: /[a-z_]{1,12}/\n'),
    "regex": Constraint(ConstraintKind.REGEX, r"[0-9]{1,3}(, [0-9]{1,3}){2,5}"),
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(FILES.target)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[tuple[int, ...]]:
    asks = [
        "Give me a person as JSON.",
        "Write a function that adds two numbers.",
        "List a few numbers.",
        "What is the capital of France?",
    ]
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": a}], add_generation_prompt=True, tokenize=False
        )
        for a in asks
    ]
    return [tuple(tokenizer.encode(c, add_special_tokens=False)) for c in chats]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(FILES.target, "--max-gamma", "8", "--dtype", "float32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def drafters() -> dict[str, LlamaDrafter]:
    return {kind: LlamaDrafter(DrafterConfig(FILES.gguf(kind), n_ctx=512)) for kind in ("q8_0", "q4_0")}


@pytest.fixture(scope="module")
def engine() -> TargetEngine:
    return TargetEngine.load(FILES.target, dtype="float32")


@pytest.fixture(scope="module")
def hf_constrained(prompts):
    """transformers' greedy `generate` under each constraint, for every prompt (end of sequence included)."""
    return {
        (name, i): ids
        for name, constraint in CONSTRAINTS.items()
        for i, ids in enumerate(
            transformers_constrained_greedy(FILES.target, prompts, NEW_TOKENS, constraint)
        )
    }


GREEDY = SamplingParams()


def _request(prompt, constraint, sampling=GREEDY, gamma=4, pipeline=0, **kw) -> GenerationRequest:
    return GenerationRequest(
        prompt, sampling, NEW_TOKENS, gamma, pipeline=pipeline, constraint=constraint, **kw
    )


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize(("gamma", "pipeline"), [(1, 0), (4, 0), (8, 0), (3, 2)])
def test_greedy_equals_transformers_generate_under_the_same_mask(
    server, drafters, prompts, hf_constrained, tokenizer, name, gamma, pipeline
):
    requests = [_request(p, CONSTRAINTS[name], gamma=gamma, pipeline=pipeline) for p in prompts]
    results = speculate(server.address, drafters["q8_0"], requests)
    for i, (ids, _) in enumerate(results):
        assert ids == hf_constrained[name, i], f"prompt {i}: {tokenizer.decode(ids)!r}"
    if name == "json_schema":  # what the mask is for: finished replies parse and hold to the schema
        for ids, _ in results:
            if ids[-1] == tokenizer.eos_token_id:
                person = json.loads(tokenizer.decode(ids[:-1]))
                assert set(person) <= set(PERSON["properties"]) and {"name", "age"} <= set(person)
                assert isinstance(person["age"], int)


def test_the_draft_proposes_under_the_mask(server, drafters, prompts, tokenizer):
    """Masked, the draft keeps the target's acceptance under a schema; unmasked it would propose prose
    where the mask allows a brace. Its acceptance under the schema stays near the unconstrained one."""

    def acceptance(constraint) -> float:
        results = speculate(server.address, drafters["q8_0"], [_request(p, constraint) for p in prompts])
        return sum(s.accepted_tokens for _, s in results) / sum(s.draft_tokens for _, s in results)

    free, schema = acceptance(None), acceptance(CONSTRAINTS["json_schema"])
    assert schema >= free - 0.15, (schema, free)
    assert schema > 0.5


def test_forced_tokens_cost_no_draft_step_and_no_gamma(drafters, prompts, tokenizer):
    """Where the schema allows one token alone (the opening brace, a key, its quotes), the draft appends
    it without a draft step and without spending γ, up to the proposal's cap (`most`). The tokens it
    gives are what the target under the same mask would write (the tests above), and the draft names
    them, for the acceptance counts the draft model's tokens alone."""
    drafter, prompt = drafters["q8_0"], list(prompts[0])
    matcher = drafter.constraint_matcher(CONSTRAINTS["json_schema"], [tokenizer.eos_token_id])
    forced = len(matcher.forced())
    assert forced >= 2, tokenizer.decode(matcher.forced())  # a run to begin with: {"name":"...
    drafter.propose(prompt[:-1], 1, GREEDY)  # the prompt (all but its last token) in the draft's cache
    before = drafter.evaluated_positions
    draft = drafter.propose(prompt, 1, GREEDY, (), len(prompt), matcher=matcher, most=8)
    assert len(draft) == forced + 1 + len(matcher.forced()[: 8 - forced - 1])  # forced, one choice, forced
    assert draft.forced == set(range(len(draft))) - {forced}  # named, so that no stat counts them drafted
    # One step for the prompt's last token, one for the forced run: none for each forced token.
    assert drafter.evaluated_positions - before == 1 + forced
    assert len(drafter.propose(prompt, 1, GREEDY, (), len(prompt), matcher=matcher, most=2)) == 2
    assert drafter.propose(prompt, 1, GREEDY, (), len(prompt), matcher=matcher) == draft[:1]  # no cap: γ


@pytest.mark.parametrize("name", ["json_schema", "regex"])
def test_seeded_equals_reference_whatever_gamma_pipeline_and_draft(server, drafters, engine, prompts, name):
    constraint = CONSTRAINTS[name]
    for seed in (1, 2, 3):
        sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
        prompt = prompts[seed % len(prompts)]
        expected = reference_decode(engine, SessionSpec(prompt, sampling, NEW_TOKENS, constraint=constraint))
        for draft, gamma, pipeline in [("q8_0", 1, 0), ("q8_0", 4, 0), ("q4_0", 8, 0), ("q4_0", 3, 2)]:
            [(ids, _)] = speculate(
                server.address, drafters[draft], [_request(prompt, constraint, sampling, gamma, pipeline)]
            )
            assert ids == expected, f"seed {seed}, draft {draft}, gamma {gamma}, pipeline {pipeline}"


def test_batched_and_thin_sessions_equal_reference(server, drafters, engine, prompts):
    """Constrained sessions of every kind at once, with unconstrained ones and thin ones (the verifier
    drafting by prompt lookup, or not at all), batched in the verifier's forwards."""
    cases = [
        (p, c, SamplingParams(temperature=t, seed=7), drafting)
        for p, c in zip(prompts, CONSTRAINTS.values(), strict=True)
        for t in (0.0, 0.8)
        for drafting in (Drafting.EDGE, Drafting.NGRAM, Drafting.NONE)
    ] + [(prompts[0], None, SamplingParams(), Drafting.EDGE)]
    expected = [reference_decode(engine, SessionSpec(p, s, NEW_TOKENS, constraint=c)) for p, c, s, _ in cases]

    async def run():
        async with wire.insecure_channel(server.address) as channel:
            edges = [
                EdgeSession(channel, drafters["q8_0"] if d is Drafting.EDGE else None) for *_, d in cases
            ]
            for edge in edges:
                edge.vocabulary = drafters["q8_0"].vocabulary
            return await asyncio.gather(
                *(
                    edge.run(_request(p, c, s, drafting=d))
                    for edge, (p, c, s, d) in zip(edges, cases, strict=True)
                )
            )

    results = asyncio.run(run())
    for case, want, (ids, _) in zip(cases, expected, results, strict=True):
        assert ids == want, case[1:]
    # A thin session drafting nothing commits each run its constraint forces in one forward
    # (own_proposal): fewer rounds than tokens, the forced tokens counted as such and never as drafts.
    # The schema forces its keys at least, and the grammar its "def ".
    forcing = (CONSTRAINTS["json_schema"], CONSTRAINTS["grammar"])
    for (_, constraint, _, drafting), (ids, stats) in zip(cases, results, strict=True):
        if drafting is Drafting.NONE and constraint is not None:
            assert stats.draft_tokens == 0 and stats.rounds == len(ids) - stats.forced_tokens, constraint
            assert stats.forced_tokens > 0 or constraint not in forcing, constraint
        if drafting is Drafting.NGRAM and constraint in forcing:  # the verdicts say which runs were forced
            assert stats.forced_tokens > 0, constraint


def test_logprobs_are_those_of_the_masked_distribution(server, drafters, engine, prompts):
    """The logprobs are the reference's, the mask's: a token the constraint forbids has none, a token it
    forces has probability 1."""
    constraint = CONSTRAINTS["json_schema"]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
        spec = SessionSpec(prompts[0], sampling, NEW_TOKENS, top_logprobs=3, constraint=constraint)
        expected_lp = []
        expected = reference_decode(engine, spec, expected_lp)

        async def run(request):
            async with wire.insecure_channel(server.address) as channel:
                lp = []
                ids, _ = await EdgeSession(channel, drafters["q8_0"]).run(request, lp)
                return ids, lp

        ids, logprobs = asyncio.run(run(_request(prompts[0], constraint, sampling, top_logprobs=3)))
        assert ids == expected and logprobs == expected_lp
        assert logprobs[0].logprob == 0.0  # `{` is the only token a JSON object starts with here
        for t in logprobs:
            assert np.isfinite(t.logprob)


def _open(server, constraint: pb.Constraint, **spec) -> grpc.RpcError:
    """Opens a session with `constraint` and a first proposal; returns the status it ends with."""
    open_ = pb.OpenSession(
        prompt_token_ids=[1, 2, 3], stop=pb.StopConditions(max_new_tokens=4), constraint=constraint, **spec
    )
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        messages = [
            pb.EdgeMessage(open=open_),
            pb.EdgeMessage(proposal=pb.Proposal(round=1, start_position=3)),
        ]
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Session(iter(messages), timeout=30))
        return raised.value


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (pb.Constraint(json_schema="{not json"), "constraint.json_schema"),
        (pb.Constraint(json_schema='{"type": "objekt"}'), "constraint.json_schema"),
        (pb.Constraint(json_schema='{"type": "object", "if": {}}'), "constraint.json_schema"),
        (pb.Constraint(json_schema="[1, 2]"), "constraint.json_schema"),
        (pb.Constraint(grammar="start: x\nx: 'a' | y\n"), "constraint.grammar"),
        (pb.Constraint(grammar=""), "constraint.grammar"),
        (pb.Constraint(regex="[a-z"), "constraint.regex"),
        (pb.Constraint(regex="a" * 40_000), "constraint.regex"),
        (pb.Constraint(regex="(" + "|".join(f"w{i}x{i}" * 3 for i in range(1500)) + ")"), "constraint.regex"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_field_within_a_second(server, constraint, named):
    started = time.perf_counter()
    error = _open(server, constraint)
    took = time.perf_counter() - started
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert named in error.details()
    assert took < 5  # generous: a busy machine; the compile limit itself is 1 s
    with grpc.insecure_channel(server.address) as channel:  # the server is still there
        assert pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10).constraints


def test_ignore_eos_cannot_go_with_a_constraint(server):
    open_ = pb.OpenSession(
        prompt_token_ids=[1, 2, 3],
        stop=pb.StopConditions(max_new_tokens=4, ignore_eos=True),
        constraint=pb.Constraint(json_object=True),
    )
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(pb_grpc.VerifierStub(channel).Session(iter([pb.EdgeMessage(open=open_)]), timeout=30))
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "ignore_eos" in error.details()


def test_a_constraint_cut_by_max_tokens_ends_with_length_and_its_valid_prefix(
    server, drafters, prompts, tokenizer
):
    constraint = CONSTRAINTS["json_schema"]
    request = GenerationRequest(prompts[0], SamplingParams(), 5, 4, constraint=constraint)
    [(ids, _)] = speculate(server.address, drafters["q8_0"], [request])
    assert len(ids) == 5 and tokenizer.eos_token_id not in ids  # the length cut it, not the end
    assert tokenizer.decode(ids).startswith('{"')


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_the_drafts_masks_are_the_verifiers_bit_for_bit(tokenizer, hf_constrained, name):
    """One engine on both sides: the draft's matcher, built from the GGUF's vocabulary, gives the masks the
    verifier's gives from transformers' tokenizer, at every position of a constrained reply."""
    from edge_client.drafter import grammar_tokenizer
    from edge_client.llama_runtime import Llama
    from verifier_service.constraints import hf_grammar_tokenizer

    eos = [tokenizer.eos_token_id]
    llm = Llama(model_path=str(FILES.gguf("q8_0")), vocab_only=True, verbose=False)
    verifier = compile_constraint(CONSTRAINTS[name], hf_grammar_tokenizer(tokenizer, None, eos))
    draft = compile_constraint(CONSTRAINTS[name], grammar_tokenizer(llm, eos))
    reply = [t for t in hf_constrained[name, 0] if t not in eos]
    for i in range(len(reply) + 1):
        assert (verifier.allowed() == draft.allowed()).all(), i
        verifier.follow(reply[: i + 1])
        draft.follow(reply[: i + 1])
