"""Structured output's logic over a byte-level vocabulary built here: the matcher that follows a session's
tokens (masks, roll-backs, masks along a draft), the checks that name a bad constraint's field, the wire's
constraint, and a verifier session that masks every position of a round (over the fake engine)."""

import asyncio
import dataclasses
import json

import llguidance
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from draftwire import wire
from draftwire.contract import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    ConstraintKind,
    Drafting,
    Proposal,
    SamplingParams,
    SessionSpec,
)
from draftwire.grammar import InvalidConstraint, compile_constraint
from draftwire.rules import choose_tokens, masked_logits
from tools.testkit.fakes import FakeEngine, fake_info
from verifier_service.batcher import Batcher
from verifier_service.session import InvalidRequest, VerifierSession, WrongState, decode_alone

EOS = 256
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    """256 byte-level tokens (id = the byte) and an end-of-sequence token, 256."""
    return llguidance.LLTokenizer(_byte_level_tokenizer().to_str(), eos_token=EOS)


def _byte_level_tokenizer() -> Tokenizer:
    """A tokenizers tokenizer of the 256 bytes (id = the byte) and `<eos>` at 256."""
    hf = Tokenizer(models.BPE(vocab=_byte_level_vocab(), merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<eos>"])
    assert hf.token_to_id("<eos>") == EOS
    return hf


def _byte_level_vocab() -> dict[str, int]:
    """GPT-2's byte-level characters, each at the id of the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    vocab, n = {}, 0
    for b in range(256):
        if b in printable:
            vocab[chr(b)] = b
        else:
            vocab[chr(256 + n)] = b
            n += 1
    return vocab


def ids(text: str) -> list[int]:
    return list(text.encode())


def schema() -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))


def test_the_vocabulary_is_the_bytes(tokenizer):
    assert tokenizer.vocab_size == 257
    assert tokenizer.tokenize_str('{"a"') == ids('{"a"')


def test_masks_follow_the_json_the_schema_allows(tokenizer):
    m = compile_constraint(schema(), tokenizer)
    assert np.flatnonzero(m.allowed()).tolist() == [ord("{")]
    assert m.follow(ids('{"a": 12, "b": "')) == len(ids('{"a": 12, "b": "'))
    assert np.flatnonzero(m.allowed()).tolist() == [ord("x"), ord("y")]
    assert m.follow(ids('{"a": 12, "b": "y"}')) == len(ids('{"a": 12, "b": "y"}'))
    assert np.flatnonzero(m.allowed()).tolist() == [EOS]  # complete: only the end
    assert m.accepting


def test_follow_rolls_back_to_where_the_tokens_part(tokenizer):
    m, fresh = compile_constraint(schema(), tokenizer), compile_constraint(schema(), tokenizer)
    m.follow(ids('{"a": 12, "b": "x"}'))
    assert m.follow(ids('{"a": 7')) == len(ids('{"a": 7'))
    fresh.follow(ids('{"a": 7'))
    assert (m.allowed() == fresh.allowed()).all()


def test_follow_stops_before_a_refused_token_and_stays_usable(tokenizer):
    m = compile_constraint(schema(), tokenizer)
    assert m.follow(ids('{"a": x')) == len(ids('{"a": '))
    assert not m.error
    assert m.allowed()[ord("5")] and not m.allowed()[ord("x")]


def test_masks_along_a_draft_are_each_positions_and_leave_the_matcher_where_it_was(tokenizer):
    m = compile_constraint(schema(), tokenizer)
    m.follow(ids("{"))
    before = m.allowed()
    draft = ids('"a": 3')
    rows = m.masks(draft)
    step = compile_constraint(schema(), tokenizer)
    step.follow(ids("{"))
    for i in range(len(draft)):
        assert (rows[i] == step.allowed()).all(), i
        step.follow(ids("{") + draft[: i + 1])
    assert (rows[-1] == step.allowed()).all()
    assert (m.allowed() == before).all() and m.tokens == ids("{")


def test_masks_past_a_refused_draft_token_repeat_the_last(tokenizer):
    m = compile_constraint(schema(), tokenizer)
    rows = m.masks(ids('{x"a'))
    assert rows[1][ord('"')] and not rows[1][ord("x")]
    assert (rows[2] == rows[1]).all() and (rows[3] == rows[1]).all()


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "constraint.json_schema is not JSON"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "[1]"), "constraint.json_schema must be a JSON object"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "objekt"}'), "constraint.json_schema"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"if": {"type": "string"}}'), "Unimplemented keys"),
        (Constraint(ConstraintKind.GRAMMAR, "start: x\nx: 'a' | y\n"), "constraint.grammar"),
        (Constraint(ConstraintKind.GRAMMAR, ""), "constraint.grammar is empty"),
        (Constraint(ConstraintKind.REGEX, "[a-z"), "constraint.regex"),
        (Constraint(ConstraintKind.REGEX, "a" * (MAX_CONSTRAINT_BYTES + 1)), "at most 32768"),
    ],
)
def test_a_bad_constraint_names_its_field(tokenizer, constraint, says):
    with pytest.raises(InvalidConstraint, match=says.replace("(", r"\(")):
        compile_constraint(constraint, tokenizer)


def test_masked_logits_keep_the_dtype_and_refuse_ids_past_the_mask():
    scores = np.arange(12, dtype=np.float32).reshape(2, 6)
    allowed = np.array([[True, False, True, False], [False, True, False, True]])
    out = masked_logits(scores, allowed)
    assert out.dtype == np.float32 and scores[0, 1] == 1  # a new array: the logits are not touched
    assert np.isneginf(out[:, 4:]).all()
    assert out[0].tolist()[:4] == [0, -np.inf, 2, -np.inf] and out[1].tolist()[:4] == [-np.inf, 7, -np.inf, 9]


def test_a_mask_wider_than_the_vocabulary_masks_the_ids_that_exist():
    """A tokenizer that lists more tokens than the model's vocabulary (Qwen2.5: 151,936 against 151,665):
    the mask's extra columns name ids that the scores do not have. A round under a schema on the Qwen
    pair failed with `could not broadcast (8,151936) into (8,151665)`."""
    scores = np.zeros((2, 4), dtype=np.float32)
    allowed = np.array([[True, False, True, False, True, True], [False, True, False, True, False, False]])
    out = masked_logits(scores, allowed)
    assert out.shape == (2, 4)
    assert out[0].tolist() == [0, -np.inf, 0, -np.inf] and out[1].tolist() == [-np.inf, 0, -np.inf, 0]


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.JSON_OBJECT),
        Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        Constraint(ConstraintKind.GRAMMAR, 'start: "a"'),
        Constraint(ConstraintKind.REGEX, "[0-9]+"),
        None,
    ],
)
def test_the_wire_carries_the_constraint(constraint):
    spec = SessionSpec((1, 2), constraint=constraint)
    message = wire.spec_to_proto(spec)
    assert wire.spec_from_proto(type(message).FromString(message.SerializeToString())) == spec


def test_json_object_false_is_no_constraint():
    message = wire.spec_to_proto(SessionSpec((1,)))
    message.constraint.json_object = False
    assert wire.spec_from_proto(message).constraint is None


# --- the verifier's session over the fake engine --------------------------------------------------------


@pytest.fixture
def engine(tokenizer):
    engine = FakeEngine(dataclasses.replace(fake_info(257, max_context=512), eos_token_ids=(EOS,)))
    engine.tokenizer = "the target's (its llguidance tokenizer is set below)"
    engine._grammar_tokenizer = tokenizer
    return engine


def _decode(engine, spec: SessionSpec, drafts=None, logprobs=None) -> list[int]:
    """The session to its end: the target alone (drafts None; its logprobs into `logprobs` when given),
    or rounds of the given draft tokens."""

    async def run():
        batcher = Batcher(engine)
        try:
            if drafts is None:
                return await decode_alone(batcher, spec, logprobs)
            session = await VerifierSession.open(batcher, spec)
            while session.finish is None:
                draft = tuple(drafts(session.generated))
                await session.play(Proposal(session.last_round + 1, len(session.committed), draft))
            return session.generated
        finally:
            batcher.close()

    return asyncio.run(run())


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.5, seed=9)])
def test_a_session_masks_every_position_whatever_the_draft(engine, tokenizer, sampling):
    spec = SessionSpec((5, 6, 7), sampling, max_new_tokens=60, constraint=schema())
    alone = _decode(engine, spec)
    text = bytes(t for t in alone if t != EOS).decode()
    if alone[-1] == EOS:
        assert json.loads(text).keys() == {"a", "b"}
    else:
        assert text.startswith('{"a": ')  # cut by the length: the valid prefix
    # The output's own tokens as drafts (all accepted), junk (each rejected), and a mix: the same output.
    for drafts in (
        lambda g: alone[len(g) : len(g) + 4],
        lambda g: [ord("z")] * 3,
        lambda g: [*alone[len(g) : len(g) + 2], ord("z"), *alone[len(g) + 3 : len(g) + 5]],
    ):
        assert _decode(engine, spec, drafts) == alone


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.5, seed=9)])
@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("drafting", [Drafting.NONE, Drafting.NGRAM])
def test_a_thin_session_commits_a_forced_run_in_one_forward(engine, sampling, logprobs, drafting):
    """A thin session (the verifier decoding alone) drafts the tokens its constraint forces: one forward
    commits the run and the token after it, with the tokens and logprobs of one token per forward
    (`decode_alone`). The verdict says which server drafts were forced, and the counters count them as
    forced, not drafted (prompt lookup's own drafts still count as drafts)."""
    spec = SessionSpec((5, 6, 7), sampling, 40, constraint=schema(), drafting=drafting, top_logprobs=logprobs)
    alone_logprobs: list = []
    alone = _decode(engine, spec, logprobs=alone_logprobs)

    async def thin():
        batcher = Batcher(engine)
        session = await VerifierSession.open(batcher, spec)
        verdicts = []
        while session.finish is None:
            verdicts.append(await session.play(session.own_proposal()))
        batcher.close()
        return session, verdicts

    session, verdicts = asyncio.run(thin())
    assert session.generated == alone
    assert verdicts[0].server_draft_token_ids == tuple(ids('{"a": '))  # the opening run, in one round
    assert len(verdicts) < len(alone)
    assert [lp for v in verdicts for lp in v.logprobs] == alone_logprobs
    forced = [v for v in verdicts if v.server_forced_tokens]
    assert verdicts[0].server_forced_tokens == len(ids('{"a": '))
    assert all(v.server_forced_tokens == len(v.server_draft_token_ids) for v in forced)
    assert session.stats.forced_tokens == sum(v.accepted for v in forced) >= len(ids('{"a": '))
    drafted = [v for v in verdicts if v.server_draft_token_ids and not v.server_forced_tokens]
    assert session.stats.draft_tokens == sum(len(v.server_draft_token_ids) for v in drafted)
    assert session.stats.drafts == len(drafted)
    if drafting is Drafting.NONE:
        assert (session.stats.drafts, session.stats.draft_tokens) == (0, 0)


def test_the_mask_decides_against_the_logits(engine):
    """The fake target peaks at no brace: unconstrained it writes no JSON, constrained it must."""
    free = _decode(engine, SessionSpec((5, 6, 7), max_new_tokens=10))
    forced = _decode(engine, SessionSpec((5, 6, 7), max_new_tokens=10, constraint=schema()))
    assert free[0] != ord("{") and forced[:6] == ids('{"a": ')
    scores = engine.logits([7]).numpy()
    assert choose_tokens(scores, 3, SamplingParams())[0] == free[0]


def test_a_resume_must_hold_to_the_constraint(engine):
    good = SessionSpec((5,), max_new_tokens=20, constraint=schema(), generated_token_ids=tuple(ids('{"a"')))
    assert _decode(engine, good)[:4] == ids('{"a"')
    bad = dataclasses.replace(good, generated_token_ids=tuple(ids('{"z"')))
    with pytest.raises(InvalidRequest, match="breaks the session's constraint"):
        _decode(engine, bad)


def test_ignore_eos_and_a_constraint_are_refused(engine):
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        _decode(engine, SessionSpec((5,), max_new_tokens=5, ignore_eos=True, constraint=schema()))


def test_an_engine_without_a_tokenizer_serves_no_constraint():
    with pytest.raises(WrongState, match="serves no constraint"):
        _decode(FakeEngine(), SessionSpec((5,), max_new_tokens=5, constraint=schema()))


def test_a_non_special_added_token_is_text_to_the_verifiers_masks():
    """Qwen2's `<tool_call>` is an added token that transformers keeps as text (special=False). The
    verifier's grammar tokenizer comes from the fingerprinted token table, so the token is the text it
    stands for, as on the edge: a grammar that asks for that text allows it and goes on past it.
    (`llguidance.hf` took it for a special token, allowed it in the mask and then failed on consuming it:
    every tool call on the Qwen pair ended in an internal error.)"""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from verifier_service.constraints import grammar_tokenizer

    raw = _byte_level_tokenizer()
    raw.add_tokens([AddedToken("<tool_call>", special=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    call = hf.convert_tokens_to_ids("<tool_call>")
    info = dataclasses.replace(fake_info(len(hf), max_context=512), eos_token_ids=(EOS,))
    engine = FakeEngine(info)
    engine.tokenizer = hf
    lark = 'start: "<tool_call>\\n" /[a-z]+/ "\\n</tool_call>"'
    matcher = compile_constraint(Constraint(ConstraintKind.GRAMMAR, lark), grammar_tokenizer(engine))
    draft = [call, ord("\n"), ord("a")]
    rows = matcher.masks(draft)
    assert rows[0][call] and rows[1][ord("\n")] and rows[2][ord("a")] and not rows[2][EOS]
    assert matcher.error == "" and matcher.follow(draft) == 3
