"""The fuzz campaign's cases (tools/stress/fuzz.py), as hypothesis strategies: Session streams of mutated
opens and proposals, fields written byte by byte at and past their limits, live sessions whose proposals
follow the session's real state with one thing wrong, health calls, and authorization metadata."""

from __future__ import annotations

import collections
import math
import struct
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from draftwire import wire
from draftwire.contract import MIN_DIVISOR
from draftwire.v1 import draftwire_pb2 as pb
from tools.stress.rawwire import U64, field_bytes, tag

SERVICE = "/draftwire.v1.Verifier/"
PATHS = [SERVICE + m for m in ("GetModelInfo", "GetStats", "Session", "Nope")] + [
    "/grpc.health.v1.Health/Check"
]
HEALTH = "/grpc.health.v1.Health/"
U32 = 2**32 - 1
CLIENT_RACE = "Internal error from Core"  # what grpc's aio client says when a write meets the status


# --- strategies ---

FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
)
U32S = st.one_of(st.sampled_from([0, 1, 2**31 - 1, 2**31, U32]), st.integers(0, U32))
U64S = st.one_of(st.sampled_from([0, 1, 2**31, U32, 2**63 - 1, 2**63, U64]), st.integers(0, U64))
WILD = st.one_of(  # any 64-bit value a varint can carry, as a signed int: for fields written by hand
    st.sampled_from([-1, -(2**31), -(2**63), 2**31, 2**32, 2**63 - 1, U32, U64]), st.integers(-(2**63), U64)
)


def ids(vocab: int):
    return st.one_of(st.integers(0, vocab - 1), st.integers(0, vocab - 1), st.sampled_from([vocab, U32]))


def id_lists(vocab: int, max_size: int, sizes: tuple[int, ...]):
    """Mostly short lists; sometimes one id repeated a limit's length (sizes), up to past 1 MiB."""
    repeated = st.builds(lambda n, v: [v] * n, st.sampled_from(sizes), ids(vocab))
    return st.one_of(
        st.lists(ids(vocab), max_size=max_size), st.lists(ids(vocab), max_size=max_size), repeated
    )


def sometimes(valid, wild):
    """Mostly the valid value, sometimes a wild one."""
    return st.one_of(st.just(valid), st.just(valid), st.just(valid), wild)


@dataclass(frozen=True)
class Step:
    """A Session message built when sent: `next_round` / `follow` / `assume` fill in the session's
    state (the next round, the committed length, the committed tokens before it)."""

    message: pb.EdgeMessage | bytes
    next_round: bool = False
    follow: bool = False
    assume: int = 0

    def encode(self, state: State) -> bytes:
        if isinstance(self.message, bytes):
            return self.message
        m = pb.EdgeMessage()
        m.CopyFrom(self.message)
        if m.WhichOneof("kind") == "proposal":
            p = m.proposal
            if self.next_round:
                p.round = min(state.round + 1, U64)
            if self.follow:
                p.start_position = state.committed_length
            if self.assume:
                del p.assumed_token_ids[:]
                p.assumed_token_ids.extend(state.committed[-self.assume :])
            state.round = p.round
            state.drafts.append(list(p.draft_token_ids))
        elif m.WhichOneof("kind") == "open":
            state.committed = [*m.open.prompt_token_ids, *m.open.generated_token_ids]
        return m.SerializeToString()

    def __repr__(self) -> str:
        text = self.message if isinstance(self.message, bytes) else str(self.message).replace("\n", " ")
        flags = "".join(
            c for c, on in zip("NFA", (self.next_round, self.follow, self.assume), strict=True) if on
        )
        return f"Step({str(text)[:160]}{' ' + flags if flags else ''})"


@dataclass
class State:
    """What the fuzzer knows of its session, from its messages and the verifier's replies."""

    round: int = 0
    committed_length: int = 0
    committed: list[int] = field(default_factory=list)
    drafts: collections.deque = field(default_factory=collections.deque)

    def observe(self, reply: pb.VerifierMessage) -> None:
        if reply.WhichOneof("kind") == "opened":
            self.committed_length = reply.opened.committed_length
            return
        v = reply.verdict
        draft = self.drafts.popleft() if self.drafts else list(v.server_draft_token_ids)
        if not v.stale:
            self.committed += draft[: v.accepted] + (
                [v.target_token_id] if v.HasField("target_token_id") else []
            )
        self.committed_length = v.committed_length
        self.committed = (self.committed + [0] * v.committed_length)[: v.committed_length]


MUTATIONS = (  # what a live session's proposal can have wrong (odd but valid: unknown_field, assumed_right)
    *("round_repeat", "round_gap", "round_zero", "round_max", "start_back", "start_ahead", "start_max"),
    *("gamma_zero", "gamma_over", "gamma_huge", "id_vocab", "id_u32", "assumed_right", "assumed_wrong"),
    *("assumed_over", "bytes", "cut", "unknown_field", "wire_type", "negative_round", "cancel"),
)


@dataclass(frozen=True)
class Live:
    """A proposal of a live session, built from its real state when sent: the next round, from the
    committed length, `draft` cut to γ; or with one thing wrong (`mutation`, with `detail` choosing a
    byte, an id or a size). `ahead`: sent before the verdict of the one before, drafted on it accepted
    whole and `detail` as the bonus (pipelining). `replies`: the replies to read after it in lockstep."""

    draft: tuple[int, ...]
    mutation: str = ""
    detail: int = 0
    ahead: bool = False
    replies: int = 1
    limits: tuple[int, int] = field(default=(1, 1), repr=False)  # vocabulary size, max γ

    def encode(self, state: State) -> bytes:
        vocab, gamma = self.limits
        m, d = self.mutation, self.detail
        draft = list(self.draft[:gamma])
        round_, start, assumed = state.round + 1, state.committed_length, []
        if self.ahead and state.drafts:
            pending = state.drafts[-1]
            start += len(pending) + 1
            assumed = [*pending, d % vocab][-(gamma + 1) :]
        round_ = {
            "round_repeat": state.round,
            "round_gap": state.round + 2,
            "round_zero": 0,
            "round_max": U64,
        }.get(m, round_)
        start = {
            "start_back": max(start - 1 - d % 4, 0),
            "start_ahead": start + 1 + d % 4,
            "start_max": U64,
        }.get(m, start)
        if m == "gamma_zero":
            draft = []
        elif m in ("gamma_over", "gamma_huge"):
            draft = [draft[0]] * (gamma + 1 if m == "gamma_over" else (1000, 100_000, 600_000)[d % 3])
        elif m in ("id_vocab", "id_u32"):
            draft[d % len(draft)] = vocab if m == "id_vocab" else U32
        elif m in ("assumed_right", "assumed_wrong", "assumed_over"):
            k = gamma + 2 if m == "assumed_over" else 1 + d % (gamma + 1)
            assumed = (state.committed + [0] * k)[-k:] if m == "assumed_over" else state.committed[-k:]
            if m == "assumed_wrong" and assumed:
                assumed[-1] = (assumed[-1] + 1) % vocab
        round_ = min(round_, U64)
        start = min(start, U64)
        state.round = round_
        state.drafts.append(draft)
        p = pb.Proposal(round=round_, start_position=start, draft_token_ids=draft, assumed_token_ids=assumed)
        data = pb.EdgeMessage(proposal=p).SerializeToString()
        if m == "bytes":
            data = data[: d % len(data)] + bytes([d >> 8 & 255]) + data[d % len(data) + 1 :]
        elif m == "cut":
            data = data[: d % len(data)]
        elif m == "unknown_field":  # proto3 keeps it and the round stays valid
            data += field_bytes(5 + d % 200, d)
        elif m == "wire_type":  # the round as fixed64 where a varint belongs
            inner = tag(1, 1) + struct.pack("<Q", round_) + field_bytes(2, start) + field_bytes(3, draft)
            data = field_bytes(2, inner)
        elif m == "negative_round":  # a 10-byte varint: -1 as int64, 2^64 - 1 as uint64
            data = field_bytes(2, field_bytes(1, -1 - d % 3) + field_bytes(2, start) + field_bytes(3, draft))
        return data


def live_sessions(info: pb.ModelInfo):
    """Sessions that reach deep: a valid open (ids in the vocabulary, sampling parameters at and inside
    their limits, a few resumed ids, sometimes a thin session), then proposals that follow the session's
    real state, some valid, some pipelined, one maybe mutated, then maybe more. Always in lockstep."""
    vocab, gamma, context = info.vocab_size, info.max_gamma, info.max_context
    token = st.integers(0, vocab - 1)
    temperature = st.one_of(
        st.just(0.0),
        st.just(0.0),
        # The least temperature but 0 (draftwire.contract.MIN_DIVISOR) and on: smaller ones are invalid.
        st.sampled_from([MIN_DIVISOR, 1e-3, 0.7, 1.0, 2.0, 1e6, 1e308]),
        st.floats(0.01, 4.0),
    )
    top_k = st.one_of(
        st.just(0), st.sampled_from([1, 2, vocab - 1, vocab, vocab + 1, U32]), st.integers(0, vocab)
    )
    top_p = st.one_of(st.none(), st.sampled_from([5e-324, 1e-9, 0.5, 1.0]), st.floats(0, 1, exclude_min=True))

    def open_(prompt, generated, t, k, p, seed_, max_new, stops, ignore_eos, drafting):
        # Resumed ids count towards max_new_tokens, and the prompt plus max_new_tokens fit the context.
        new = min(max_new, 24) if drafting else max_new  # a thin session runs to its finish: keep it short
        max_new = max(min(len(generated) + new, context - len(prompt)), 1)
        sampling = pb.SamplingParams(
            temperature=t, top_k=k, seed=seed_, **({} if p is None else {"top_p": p})
        )
        stop = pb.StopConditions(max_new_tokens=max_new, stop_token_ids=stops, ignore_eos=ignore_eos)
        return Step(
            pb.EdgeMessage(
                open=pb.OpenSession(
                    prompt_token_ids=prompt,
                    generated_token_ids=generated,
                    sampling=sampling,
                    stop=stop,
                    tokenizer_fingerprint=info.tokenizer_fingerprint,
                    vocab_size=vocab,
                    drafting=drafting,
                )
            )
        )

    opens = st.builds(
        open_,
        st.lists(token, min_size=1, max_size=32),
        st.one_of(st.just([]), st.just([]), st.lists(token, max_size=6)),
        temperature,
        top_k,
        top_p,
        U64S,
        st.one_of(st.integers(1, 24), st.integers(1, 24), st.sampled_from([1, context])),
        st.one_of(st.just([]), st.just([]), st.lists(token, max_size=4)),
        st.booleans(),
        st.sampled_from([0, 0, 0, 0, 0, 0, 1, 2]),
    )
    drafts = st.lists(token, min_size=1, max_size=gamma).map(tuple)
    limits = (vocab, gamma)
    valid = st.builds(lambda d: [Live(d, limits=limits)], drafts)
    pipelined = st.builds(
        lambda d1, d2, bonus: [Live(d1, replies=0, limits=limits), Live(d2, "", bonus, True, 2, limits)],
        drafts,
        drafts,
        token,
    )
    mutated = st.builds(
        lambda d, m, detail: [Live(d, m, detail, limits=limits)],
        drafts,
        st.sampled_from(MUTATIONS),
        st.integers(0, 2**16),
    )
    moves = st.lists(st.one_of(valid, valid, valid, pipelined), min_size=1, max_size=6)
    later = st.one_of(st.just([]), st.just([]), mutated, st.builds(lambda o: [o], opens))  # or a second open
    plan = st.builds(
        lambda a, m, b: [s for move in (*a, m, *b) for s in move], moves, later, st.lists(valid, max_size=2)
    )
    return st.builds(lambda o, p: ("session", [o, *p], True), opens, plan)


# Structured output: valid, broken and random schemas, grammars and regular expressions (docs/design.md).
_SOURCES = {
    "json_schema": ['{"type": "object"}', '{"type": "objekt"}', '{"if": {}}', "[", '{"$ref": "#/x"}', "{}"],
    "grammar": ['start: "a" | "b"', "start: x", "start: /(/", "%ignore"],
    "regex": ["[0-9]+", "(a|b", "a{99999}", "(a*)*b", "\\"],
}
CONSTRAINTS = st.one_of(
    st.just(pb.Constraint(json_object=True)),
    *(
        st.builds(
            lambda source, kind=kind: pb.Constraint(**{kind: source}),
            st.one_of(st.sampled_from(valid), st.text(max_size=300)),
        )
        for kind, valid in _SOURCES.items()
    ),
)


def cases(info: pb.ModelInfo):
    """Every case: ("session", [Step or Live], lockstep), ("unary", path, bytes) or ("health", method,
    bytes)."""
    vocab, gamma, context = info.vocab_size, info.max_gamma, info.max_context
    prompt_sizes = (0, 1, context - 1, context, context + 1, 600_000)  # the last: over 1 MiB
    stop = st.builds(
        pb.StopConditions,
        max_new_tokens=st.one_of(st.integers(1, 24), st.integers(1, 24), U32S),
        stop_token_ids=id_lists(vocab, 8, (256, 257, 5000)),
        ignore_eos=st.booleans(),
    )
    sampling = st.builds(
        lambda t, k, p, s: pb.SamplingParams(
            temperature=t, top_k=k, seed=s, **({} if p is None else {"top_p": p})
        ),
        sometimes(0.0, st.one_of(st.just(0.8), FLOATS)),
        sometimes(0, U32S),
        sometimes(None, FLOATS),
        U64S,
    )
    opens = st.builds(
        pb.OpenSession,
        prompt_token_ids=sometimes([5, 60, 70, 80], id_lists(vocab, 32, prompt_sizes)),
        sampling=sampling,
        stop=stop,
        tokenizer_fingerprint=sometimes(info.tokenizer_fingerprint, st.text(max_size=70)),
        generated_token_ids=sometimes([], id_lists(vocab, 8, (context, 5000))),
        vocab_size=sometimes(vocab, U32S),
        drafting=st.one_of(st.just(0), st.just(0), st.sampled_from([0, 1, 2, 3, 2**31 - 1, -1])),
        constraint=sometimes(None, CONSTRAINTS),
    ).map(lambda o: Step(pb.EdgeMessage(open=o)))
    proposals = st.builds(
        lambda r, s, d, a, nr, fo, asm: Step(
            pb.EdgeMessage(
                proposal=pb.Proposal(round=r, start_position=s, draft_token_ids=d, assumed_token_ids=a)
            ),
            next_round=nr,
            follow=fo,
            assume=asm,
        ),
        U64S,
        U64S,
        id_lists(vocab, gamma + 2, (0, gamma, gamma + 1, 1000, 600_000)),
        id_lists(vocab, gamma + 3, (gamma + 1, gamma + 2, 1000)),
        sometimes(True, st.just(False)),
        sometimes(True, st.just(False)),
        sometimes(0, st.integers(1, gamma + 2)),
    )
    raw_open = st.builds(  # numbers past their declared width: negative, 64-bit, wrong wire types
        lambda prompt, t, p, k, seed_, max_new, vs, dr, extra: field_bytes(
            1,
            field_bytes(1, prompt)
            + field_bytes(
                2, field_bytes(1, t) + field_bytes(2, k) + field_bytes(3, p) + field_bytes(4, seed_)
            )
            + field_bytes(3, field_bytes(1, max_new))
            + field_bytes(4, info.tokenizer_fingerprint.encode())
            + field_bytes(6, vs)
            + field_bytes(7, dr)
            + extra,
        ),
        st.lists(WILD, min_size=1, max_size=6),
        st.one_of(FLOATS, WILD),
        st.one_of(FLOATS, WILD),
        WILD,
        WILD,
        WILD,
        WILD,
        WILD,
        st.one_of(st.just(b""), st.binary(max_size=12)),
    ).map(Step)
    raw_proposal = st.builds(
        lambda r, s, d, a: Step(
            field_bytes(2, field_bytes(1, r) + field_bytes(2, s) + field_bytes(3, d) + a)
        ),
        WILD,
        WILD,
        st.lists(WILD, max_size=gamma + 2),
        st.one_of(st.just(b""), st.builds(lambda a: field_bytes(4, a), st.lists(WILD, max_size=4))),
    )
    mutated = st.builds(
        mutate,
        st.one_of(opens, proposals),
        st.lists(st.tuples(U32S, st.integers(0, 255)), max_size=4),
        st.integers(0, 3),
    )
    anything = st.one_of(opens, proposals, raw_open, raw_proposal, mutated, st.binary(max_size=40).map(Step))
    structured = st.builds(
        lambda o, ps: [o, *ps], st.one_of(opens, raw_open), st.lists(proposals, max_size=8)
    )
    session = st.tuples(
        st.just("session"), st.one_of(structured, structured, st.lists(anything, max_size=8)), st.booleans()
    )
    unary = st.tuples(
        st.just("unary"),
        st.sampled_from(PATHS),
        st.one_of(st.binary(max_size=64), mutated.map(lambda s: s.message)),
    )
    return st.one_of(session, session, live_sessions(info), live_sessions(info), unary, health_cases())


def health_cases():
    """Health `Check` and `Watch` with any service name (empty, unknown, non-ASCII, 100,000 characters)
    or bytes that are no request."""
    names = st.one_of(
        st.sampled_from(["", "draftwire.v1.Verifier", "grpc.health.v1.Health", "x" * 100_000]),
        st.text(max_size=64),
    )
    requests = st.one_of(
        names.map(lambda n: health_pb2.HealthCheckRequest(service=n).SerializeToString()),
        names.map(lambda n: health_pb2.HealthCheckRequest(service=n).SerializeToString()),
        st.binary(max_size=40),
    )
    return st.tuples(st.just("health"), st.sampled_from(["Check", "Watch"]), requests)


@dataclass(frozen=True)
class Secured:
    """A verifier with TLS and tokens: the CA its certificate chains to, a client's token (the bystander's
    and the fuzzed sessions') and an admin's token (GetStats)."""

    ca: bytes
    token: str
    admin_token: str

    def credentials(self, token: str | None = None) -> wire.ClientCredentials:
        return wire.ClientCredentials(tls=True, ca=self.ca, token=token or self.token)

    def admits(self, metadata) -> tuple[bool, bool]:
        """(admitted, admin) as the verifier must decide: by the last `authorization` value."""
        values = [v for k, v in metadata if k == "authorization"]
        last = values[-1] if values else ""
        return last in (
            f"Bearer {self.token}",
            f"Bearer {self.admin_token}",
        ), last == f"Bearer {self.admin_token}"


def auth_cases(info: pb.ModelInfo, secured: Secured):
    """("auth", path, metadata, payload, valid): a call with fuzzed `authorization` metadata (random,
    empty, oversize, non-ASCII and near-miss tokens, other schemes, repeated headers, a pool front's
    headers) and a valid request or bytes; only the exact `Bearer T` of a known token may get in."""
    t = secured.token
    printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
    near = st.one_of(
        st.builds(lambda i: t[:i] + t[i + 1 :], st.integers(0, len(t) - 1)),
        st.builds(lambda i, c: t[:i] + c + t[i + 1 :], st.integers(0, len(t) - 1), printable),
        st.sampled_from([t + "x", t[:-1], t.upper(), " " + t, t + " ", t + t, t[::-1]]),
    )
    tokens = st.one_of(
        near,
        near,
        st.text(printable, max_size=64),
        st.just(""),
        st.sampled_from([1_000, 8_000, 9_000, 17_000, 100_000]).map(lambda n: "a" * n),
        st.text(st.characters(min_codepoint=0x80), min_size=1, max_size=16),
        st.binary(min_size=1, max_size=16).map(lambda b: b.decode("latin-1")),  # control characters too
        st.sampled_from([t, secured.admin_token]),
    )
    values = st.one_of(
        tokens.map(lambda x: "Bearer " + x),
        tokens.map(lambda x: "Bearer " + x),
        st.builds(
            lambda scheme, x: scheme + x,
            st.sampled_from(["bearer ", "Bearer  ", "Basic ", "Bearer", "", "Token "]),
            tokens,
        ),
    )
    entry = st.one_of(
        st.tuples(st.just("authorization"), values),
        st.tuples(st.just("authorization"), values),
        st.tuples(
            st.sampled_from(["x-draftwire-client", "x-draftwire-admin"]),
            st.sampled_from(["ops", "1", "alice", ""]),
        ),
        st.tuples(st.just("authorization-bin"), st.binary(max_size=32)),
    )
    good = st.builds(  # a known token, last; maybe after a bad one and beside a front's headers
        lambda before, token, after: (*before, ("authorization", f"Bearer {token}"), *after),
        st.lists(entry, max_size=1),
        st.sampled_from([t, t, secured.admin_token]),
        st.lists(entry.filter(lambda e: e[0] != "authorization"), max_size=2),
    )
    sessions = live_sessions(info).map(lambda c: [s for s in c[1] if not getattr(s, "mutation", "")][:3])

    def case(path, metadata, valid, session, data):
        if path.endswith("/Session"):
            payload = session if valid else [Step(data)]
        else:
            payload = b"" if valid else data
        return ("auth", path, metadata, payload, valid)

    anything = st.builds(  # mostly refused: any metadata, any path, a valid request or bytes
        case,
        st.sampled_from(PATHS),
        st.one_of(st.lists(entry, max_size=3).map(tuple), good),
        st.booleans(),
        sessions,
        st.binary(min_size=1, max_size=24),
    )
    admitted = st.builds(  # a known token and a valid request: it must work (GetStats: admins only)
        case,
        st.sampled_from([SERVICE + m for m in ("GetModelInfo", "GetStats", "Session", "Session")]),
        good,
        st.just(True),
        sessions,
        st.just(b""),
    )
    refused = st.builds(  # no known token: refused whatever the request
        case,
        st.sampled_from([SERVICE + m for m in ("GetModelInfo", "GetStats", "Session")]),
        st.lists(entry, max_size=3).map(tuple).filter(lambda md: not secured.admits(md)[0]),
        st.booleans(),
        sessions,
        st.binary(min_size=1, max_size=24),
    )
    return st.one_of(anything, admitted, refused)


def sendable(key: str, value) -> bool:
    """Whether grpc's client sends this metadata: a value of printable ASCII, or bytes under a -bin key."""
    if key.endswith("-bin"):
        return True
    return isinstance(value, str) and all(" " <= c <= "~" for c in value)


def mutate(step: Step, edits: list[tuple[int, int]], cut: int) -> Step:
    """A serialized message with some bytes replaced (position, value) and maybe its tail cut."""
    data = bytearray(step.encode(State(committed=[1, 2, 3], committed_length=3)))
    for position, value in edits:
        if data:
            data[position % len(data)] = value
    if cut and data:
        del data[len(data) - cut % len(data) :]
    return Step(bytes(data))
