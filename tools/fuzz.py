"""`python -m tools.fuzz`: a fuzz campaign on the verifier's wire surface, driven by hypothesis.

Cases: `Session` streams of mutated opens and proposals in any order (some sent in lockstep, their
positions, rounds and assumed tokens following the session's real state so that they reach deep),
opens and proposals written byte by byte with every numeric field at and past its limits (negative,
int64 and uint64 extremes, NaN and infinities, wrong wire types), mutated serialized messages, raw
bytes on every method path, and repeated fields from empty to past the message size limit. Live
sessions: a valid open (sampling parameters at and inside their limits), then proposals built from the
session's real state, valid, pipelined or with one thing wrong, so that rounds are verified and the
mutations hit a live session. Health `Check` and `Watch` with any service name or bytes. With `--auth`
(TLS and tokens): calls with fuzzed `authorization` metadata, which must get UNAUTHENTICATED unless they
carry a known token, while the rest runs behind a valid token.

Every call has a deadline. Meanwhile a bystander session runs the same greedy generation again and
again; it must reproduce its undisturbed output every time, and health must say SERVING. Figures:
messages and sessions tried, statuses by code, crashes (the server gone), hangs (a call past its
deadline), INTERNAL statuses, auth cases refused, admitted and wrong, bystander runs and mismatches.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import math
import secrets
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from draftwire import wire
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.vocab import Vocabulary
from edge_client.planner import GenerationRequest
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, Timeouts, VerifierError

SERVICE = "/draftwire.v1.Verifier/"
PATHS = [SERVICE + m for m in ("GetModelInfo", "GetStats", "Session", "Nope")] + [
    "/grpc.health.v1.Health/Check"
]
HEALTH = "/grpc.health.v1.Health/"
U32, U64 = 2**32 - 1, 2**64 - 1
CLIENT_RACE = "Internal error from Core"  # what grpc's aio client says when a write meets the status


@dataclass(frozen=True)
class FuzzConfig:
    minutes: float = 1.0  # the campaign runs this long (when examples is None)
    examples: int | None = None  # CI: exactly this many cases, then stop
    seed: int = 0  # hypothesis' seed of the first batch (batch b uses seed + b): a run is reproducible
    batch: int = 200  # cases per hypothesis run
    deadline_s: float = 30.0  # every call's deadline; a call past it is a hang
    bystander_tokens: int = 24


@dataclass
class Figures:
    messages: int = 0  # EdgeMessages (or raw byte strings) sent
    sessions: int = 0  # Session calls
    calls: int = 0  # all calls, unary ones included
    opened: int = 0  # sessions the verifier opened
    verdicts: int = 0
    verified: int = 0  # verdicts that were not stale: rounds the target ran
    statuses: collections.Counter = field(default_factory=collections.Counter)  # by code name
    crashes: int = 0  # the server stopped answering (health unreachable)
    hangs: int = 0  # calls past their deadline
    internal: int = 0  # INTERNAL seen by the client, not counting CLIENT_RACE
    server_internal: int | None = None  # sessions the verifier ended with INTERNAL (GetStats refusals)
    findings: list[str] = field(default_factory=list)  # the first few cases behind a crash, hang, INTERNAL
    harness_errors: int = 0  # cases the fuzzer itself failed to send (its bug, not the verifier's)
    auth_cases: int = 0  # calls with fuzzed `authorization` metadata (the secured mode)
    auth_refused: int = 0  # of them, refused with UNAUTHENTICATED as they had to be
    auth_admitted: int = 0  # of them, a valid token's call that worked as it had to
    auth_wrong: int = 0  # of them, anything else: a bad token let in, a good one refused, another status
    bystander_runs: int = 0
    bystander_mismatches: int = 0
    bystander_errors: int = 0  # failed runs or resumes of the bystander
    serving: bool = True  # health said SERVING every time it was asked
    seconds: float = 0.0

    def finding(self, what: str, case) -> None:
        if len(self.findings) < 10:
            self.findings.append(f"{what}: {case!r}"[:600])

    @property
    def clean(self) -> bool:
        faults = (
            self.crashes
            or self.hangs
            or self.internal
            or self.server_internal
            or self.bystander_mismatches
            or self.auth_wrong
        )
        return not (faults or self.harness_errors) and (
            self.serving and self.bystander_runs > 0 and not self.bystander_errors
        )

    def report(self) -> dict:
        return {
            "seconds": round(self.seconds, 1),
            "messages": self.messages,
            "sessions": self.sessions,
            "calls": self.calls,
            "opened": self.opened,
            "verdicts": self.verdicts,
            "verified": self.verified,
            "statuses": dict(self.statuses.most_common()),
            "crashes": self.crashes,
            "hangs": self.hangs,
            "internal": self.internal,
            "server_internal": self.server_internal,
            "harness_errors": self.harness_errors,
            "auth": {
                "cases": self.auth_cases,
                "refused": self.auth_refused,
                "admitted": self.auth_admitted,
                "wrong": self.auth_wrong,
            },
            "bystander_runs": self.bystander_runs,
            "bystander_mismatches": self.bystander_mismatches,
            "bystander_errors": self.bystander_errors,
            "serving": self.serving,
            "clean": self.clean,
            "findings": self.findings,
        }


# --- the protobuf wire format by hand, to send what the generated classes refuse to build ---


def varint(n: int) -> bytes:
    """Protobuf varint of n; a negative n as its 64-bit two's complement (10 bytes), as int64 sends it."""
    n &= U64
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def field_bytes(number: int, value) -> bytes:
    """int: varint; float: fixed64 double; bytes: length-delimited; list of int: packed varints."""
    if isinstance(value, float):
        return tag(number, 1) + struct.pack("<d", value)
    if isinstance(value, int):
        return tag(number, 0) + varint(value)
    if isinstance(value, list):
        value = b"".join(varint(v) for v in value)
    return tag(number, 2) + varint(len(value)) + value


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
        st.sampled_from([5e-324, 1e-300, 1e-6, 0.7, 1.0, 2.0, 1e6, 1e308]),
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


# --- HTTP/2 by hand, for metadata grpc's client refuses to send (non-ASCII, control characters) ---


def _hpack_int(n: int, prefix: int, flags: int = 0) -> bytes:
    limit = (1 << prefix) - 1
    if n < limit:
        return bytes([flags | n])
    out, n = bytearray([flags | limit]), n - limit
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    return bytes([*out, n])


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field without indexing, its name and value as they are (no Huffman)."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_decode(block: bytes, table: list) -> list[tuple[bytes, bytes | None]]:
    """The fields of a header block; names from the static table come as b"" and Huffman strings as None
    (gRPC writes grpc-status and grpc-message literally)."""

    def integer(i: int, prefix: int) -> tuple[int, int]:
        limit = (1 << prefix) - 1
        n, i, shift = block[i] & limit, i + 1, 0
        if n < limit:
            return n, i
        while True:
            byte, i = block[i], i + 1
            n, shift = n + ((byte & 127) << shift), shift + 7
            if byte < 128:
                return n, i

    def string(i: int) -> tuple[bytes | None, int]:
        huffman = block[i] & 0x80
        n, i = integer(i, 7)
        return (None if huffman else block[i : i + n]), i + n

    fields, i = [], 0
    while i < len(block):
        first = block[i]
        if first & 0x80:  # indexed
            index, i = integer(i, 7)
            fields.append(table[index - 62] if index > 61 else (b"", b""))
            continue
        if first & 0xE0 == 0x20:  # dynamic table size update
            _, i = integer(i, 5)
            continue
        index, i = integer(i, 6 if first & 0x40 else 4)
        if index == 0:
            name, i = string(i)
        else:
            name = table[index - 62][0] if index > 61 else b""
        value, i = string(i)
        if first & 0x40:  # with incremental indexing
            table.insert(0, (name, value))
        fields.append((name, value))
    return fields


def raw_call(
    address: str, ca: bytes, path: str, headers: list[tuple[bytes, bytes]], body: bytes, timeout: float
):
    """One gRPC call written by hand on HTTP/2 over TLS, so that header values grpc's client refuses
    reach the server: (grpc-status as a number, or what ended the call instead, grpc-message).
    Raises OSError (a socket timeout included) when the connection fails."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cadata=ca.decode())
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout) as plain,
        context.wrap_socket(plain, server_hostname=host) as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
        pseudo = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", path.encode())]
        pseudo += [
            (b":authority", address.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        block = b"".join(_hpack_literal(k, v) for k, v in [*pseudo, *headers])
        message = b"\0" + len(body).to_bytes(4, "big") + body
        # HEADERS, then CONTINUATION frames: none past HTTP/2's default frame size (16 KiB)
        pieces = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        frames = [
            _frame(1 if n == 0 else 9, 0x4 if n == len(pieces) - 1 else 0, 1, piece)
            for n, piece in enumerate(pieces)
        ]
        tls.sendall(b"".join(frames) + _frame(0, 0x1, 1, message))
        buffer, table = b"", []
        while True:
            while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
                chunk = tls.recv(65536)
                if not chunk:
                    return "connection closed", ""
                buffer += chunk
            size, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
            if kind in (4, 6) and not flags & 1:  # SETTINGS, PING: acknowledged
                tls.sendall(_frame(kind, 1, 0, payload if kind == 6 else b""))
            elif kind == 1 and stream == 1:  # HEADERS (one frame: gRPC's are small)
                if flags & 0x8:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & 0x20:
                    payload = payload[5:]
                fields = dict(_hpack_decode(payload, table))
                if fields.get(b"grpc-status") is not None:
                    details = urllib.parse.unquote((fields.get(b"grpc-message") or b"").decode("latin-1"))
                    return int(fields[b"grpc-status"]), details
            elif kind == 3 and stream == 1:
                return f"RST_STREAM {int.from_bytes(payload[:4], 'big')}", ""
            elif kind == 7:
                return f"GOAWAY {int.from_bytes(payload[4:8], 'big')}", payload[8:].decode("latin-1")


def _header_bytes(key: str, value) -> tuple[bytes, bytes]:
    if key.endswith("-bin"):
        return key.encode(), base64.b64encode(value).rstrip(b"=")
    try:
        return key.encode(), value.encode("latin-1")
    except UnicodeEncodeError:
        return key.encode(), value.encode("utf-8", "surrogatepass")


# --- running the cases ---


class Campaign:
    """Runs cases against one verifier address and counts what comes back."""

    def __init__(
        self,
        address: str,
        config: FuzzConfig,
        figures: Figures,
        alive=lambda: True,
        secured: Secured | None = None,
    ):
        self.address, self.config, self.figures, self.alive = address, config, figures, alive
        self.secured = secured
        # Secured: every call carries the client's token as metadata, but an auth case its own.
        self.metadata = (("authorization", f"Bearer {secured.token}"),) if secured else ()
        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(self._channel())

    async def _channel(self):
        options = [("grpc.max_receive_message_length", 1 << 24)]
        if self.secured is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        credentials = grpc.ssl_channel_credentials(self.secured.ca)  # the token goes as metadata
        return grpc.aio.secure_channel(self.address, credentials, options=options)

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()

    def run(self, case) -> None:
        started, deadline = time.monotonic(), self._deadline(case)
        try:
            code = self.loop.run_until_complete(asyncio.wait_for(self._case(case), deadline + 10))
        except TimeoutError:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        except Exception as e:  # the fuzzer's own bug: say so, and go on
            self.figures.harness_errors += 1
            self.figures.finding(f"fuzzer error {e!r}", case)
            return
        f = self.figures
        f.calls += 1
        if case[0] == "auth":
            self._judge(case, code)
        if code == grpc.StatusCode.INTERNAL and self._last_details == CLIENT_RACE:
            # The verifier ended the stream (its refusal counter says with what) while this client was
            # still writing: grpc's aio client then reports this instead of the verifier's status.
            f.statuses["INTERNAL (client write race)"] += 1
            return
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and case[0] == "unary" and case[1].endswith("/Session"):
            # The verifier answers a Session called as unary with `opened`, a thin session's verdicts and
            # OK, and holds nothing; grpc's client cannot take a second message on a unary call and
            # waits for its deadline. The client's wait, not the verifier's (docs/fuzz.md).
            f.statuses["DEADLINE_EXCEEDED (Session called as unary)"] += 1
            return
        f.statuses[code.name] += 1
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started >= deadline * 0.9:
            f.hangs += 1
            f.finding("hang", case)
        elif code == grpc.StatusCode.INTERNAL:
            f.internal += 1
            f.finding(f"INTERNAL {self._last_details}", case)
        elif code == grpc.StatusCode.UNAVAILABLE and not self.alive():
            f.crashes += 1
            f.finding("crash", case)

    async def _by_hand(self, path: str, metadata, payload) -> grpc.StatusCode:
        body = payload if isinstance(payload, bytes) else payload[0].encode(State())
        headers = [_header_bytes(k, v) for k, v in metadata]
        self.figures.messages += 1
        self.figures.statuses["(sent by hand: metadata grpc's client refuses)"] += 1
        try:
            status, self._last_details = await asyncio.to_thread(
                raw_call, self.address, self.secured.ca, path, headers, body, min(5.0, self.config.deadline_s)
            )
        except TimeoutError:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        except OSError as e:
            self._last_details = repr(e)
            return grpc.StatusCode.UNAVAILABLE
        if isinstance(status, str):  # no status: the stream or the connection ended
            self._last_details = f"{status} {self._last_details}"
            return grpc.StatusCode.UNAVAILABLE
        return next((c for c in grpc.StatusCode if c.value[0] == status), grpc.StatusCode.UNKNOWN)

    def _judge(self, case, code: grpc.StatusCode) -> None:
        """An auth case's status against what the verifier must answer."""
        _, path, metadata, _, valid = case
        f, c = self.figures, grpc.StatusCode
        f.auth_cases += 1
        admitted, admin = self.secured.admits(metadata)
        if not path.startswith(SERVICE):  # health is open to anyone: judged as any call
            return
        if path.endswith("/Nope"):
            expected = c.UNIMPLEMENTED  # no such method, before any authentication
        elif not admitted:
            expected = c.UNAUTHENTICATED
        elif not valid:  # a good token with bytes: the request's status, judged as any call
            return
        elif path.endswith("/GetStats") and not admin:
            expected = c.PERMISSION_DENIED
        else:
            expected = c.OK
        if code == expected and expected != c.OK:
            f.auth_refused += 1
        elif code == c.RESOURCE_EXHAUSTED and "metadata size exceeds" in self._last_details:
            f.auth_refused += 1  # past gRPC's 16 KiB limit on metadata: refused before any handler
        elif path.endswith("/Session") and expected == c.OK and self._opened:
            f.auth_admitted += 1  # opened: what follows is the session's own business
        elif code == expected:
            f.auth_admitted += 1
        elif code == c.INTERNAL and self._last_details == CLIENT_RACE and expected != c.OK:
            f.auth_refused += 1  # refused while the client was still writing (counted apart below)
        else:
            f.auth_wrong += 1
            f.finding(f"auth: {code.name} where {expected.name} {self._last_details!r}", case)

    def _deadline(self, case) -> float:
        """A unary call (and health's first answer) comes at once: at most 5 s."""
        stream = case[0] == "session" or case[0] == "auth" and case[1].endswith("/Session")
        return self.config.deadline_s if stream else min(5.0, self.config.deadline_s)

    async def _case(self, case) -> grpc.StatusCode:
        self._last_details, self._opened, metadata = "", False, self.metadata
        if case[0] == "auth":
            _, path, metadata, payload, _ = case
            if not all(sendable(k, v) for k, v in metadata):  # grpc's client refuses it: by hand
                return await self._by_hand(path, metadata, payload)
            case = ("session", payload, True) if path.endswith("/Session") else ("unary", path, payload)
        if case[0] == "health" and case[1] == "Watch":
            # A stream that never ends: its first answer must come (SERVING, SERVICE_UNKNOWN) or a status.
            call = self.channel.unary_stream(HEALTH + "Watch")(
                case[2], timeout=self._deadline(case), metadata=metadata
            )
            self.figures.messages += 1
            try:
                first = await call.read()
            except grpc.aio.AioRpcError:
                first = grpc.aio.EOF
            if first is not grpc.aio.EOF:
                call.cancel()
                return grpc.StatusCode.OK
            self._last_details = await call.details()
            return await call.code()
        if case[0] == "health":
            case = ("unary", HEALTH + "Check", case[2])
        if case[0] == "unary":
            _, path, data = case
            call = self.channel.unary_unary(path)(data, timeout=self._deadline(case), metadata=metadata)
            self.figures.messages += 1
            try:
                await call
            except grpc.aio.AioRpcError:
                pass
            self._last_details = await call.details()
            return await call.code()
        _, steps, lockstep = case
        self.figures.sessions += 1
        call = self.channel.stream_stream(
            SERVICE + "Session", response_deserializer=pb.VerifierMessage.FromString
        )(timeout=self.config.deadline_s, metadata=metadata)
        if self.secured is not None and not self.secured.admits(metadata)[0]:
            # Refused before its handler reads anything: wait for that status before writing, or grpc's
            # client may report the write race (CLIENT_RACE) in its place.
            try:
                await asyncio.wait_for(asyncio.shield(call.code()), 1.0)
            except TimeoutError:
                pass  # not refused: the judge will say so
            if call.done():
                self._last_details = await call.details()
                return await call.code()
        state = State()
        try:
            for step in steps:
                if getattr(step, "mutation", "") == "cancel":
                    call.cancel()  # the edge goes away mid-session
                    return grpc.StatusCode.CANCELLED
                await call.write(step.encode(state))
                self.figures.messages += 1
                replies = [await call.read() for _ in range(getattr(step, "replies", 1) if lockstep else 0)]
                for reply in replies:
                    if reply is not grpc.aio.EOF:
                        self._observe(state, reply)
                if grpc.aio.EOF in replies:
                    break
            await call.done_writing()
            while (reply := await call.read()) is not grpc.aio.EOF:
                self._observe(state, reply)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the status says why
        except grpc.aio.UsageError:
            pass
        self._last_details = await call.details()
        return await call.code()

    def _observe(self, state: State, reply: pb.VerifierMessage) -> None:
        state.observe(reply)
        if reply.WhichOneof("kind") == "opened":
            self.figures.opened += 1
            self._opened = True
        else:
            self.figures.verdicts += 1
            self.figures.verified += not reply.verdict.stale


async def healthy(channel) -> bool:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Bystander(threading.Thread):
    """A well-behaved session run again and again on its own connection while the fuzzing goes on:
    greedy, drafted from its own recorded output with a share corrupted; every run must reproduce the
    output recorded before the fuzzing began."""

    def __init__(self, address: str, config: FuzzConfig, figures: Figures, secured: Secured | None = None):
        super().__init__(daemon=True)
        self.address, self.config, self.figures = address, config, figures
        self.credentials = secured.credentials() if secured else wire.PLAINTEXT
        self.ready, self.stop = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # reported by the campaign
            self.error = e
            self.ready.set()

    async def _run(self) -> None:
        f, timeouts = self.figures, Timeouts(call_s=self.config.deadline_s, verdict_s=self.config.deadline_s)
        async with wire.channel(self.address, self.credentials) as channel:
            info = await EdgeSession(channel, None, timeouts).model_info()
            vocab = Vocabulary(info.target.vocabulary.size, info.target.vocabulary.fingerprint)
            prompt = tuple(range(5, 5 + 12))
            request = GenerationRequest(prompt, max_new_tokens=self.config.bystander_tokens, ignore_eos=True)
            reference, _ = await EdgeSession(channel, ReplayDrafter(prompt, vocab, 1.0), timeouts).run(
                request
            )
            self.ready.set()
            n = 0
            while not self.stop.is_set() or n == 0:
                n += 1
                drafter = ReplayDrafter(prompt + tuple(reference), vocab, 0.3, seed=n)
                session = EdgeSession(channel, drafter, timeouts)
                try:
                    ids, stats = await session.run(request)
                    f.bystander_errors += stats.resumes
                    f.bystander_mismatches += ids != reference
                except (VerifierError, grpc.aio.AioRpcError):
                    f.bystander_errors += 1
                f.bystander_runs += 1
                f.serving &= await healthy(channel)


def run_campaign(
    address: str, config: FuzzConfig, alive=None, log=print, secured: Secured | None = None
) -> Figures:
    """Runs the campaign against the verifier at `address` (host:port): plaintext, or with TLS and
    tokens when `secured` says how (then auth cases join the others); `alive()` says whether the server
    still runs (default: its health answers). Returns the figures."""
    figures = Figures()
    bystander = Bystander(address, config, figures, secured)
    bystander.start()
    bystander.ready.wait(120)
    if bystander.error is not None:
        raise RuntimeError(f"the bystander could not start: {bystander.error!r}")
    if secured is None:
        probe, admin = grpc.insecure_channel(address), ()
    else:
        probe = grpc.secure_channel(address, grpc.ssl_channel_credentials(secured.ca))
        admin = (("authorization", f"Bearer {secured.admin_token}"),)
    info = pb.ModelInfo.FromString(
        probe.unary_unary(SERVICE + "GetModelInfo")(b"", timeout=config.deadline_s, metadata=admin)
    )

    def health() -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def internal_refusals() -> int | None:
        try:
            stats = pb.ServerStats.FromString(
                probe.unary_unary(SERVICE + "GetStats")(b"", timeout=10, metadata=admin)
            )
        except grpc.RpcError:
            return None  # not ours to read (an authenticating verifier), or gone
        return stats.refusals.get("INTERNAL", 0)

    before = internal_refusals()
    campaign = Campaign(address, config, figures, alive or health, secured)
    started = time.monotonic()
    end = started + 60 * config.minutes
    limit = config.examples

    # Auth cases: 4 of 9 branches (one_of keeps one copy of a strategy object given twice).
    fuzzed = [] if secured is None else [auth_cases(info, secured) for _ in range(4)]

    @settings(
        max_examples=config.batch if limit is None else limit,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(cases(info), *fuzzed))
    def one(case) -> None:
        if limit is None and time.monotonic() >= end or figures.crashes:
            return
        campaign.run(case)

    try:
        batch = 0
        while True:
            seed(config.seed + batch)(one)()
            batch += 1
            elapsed = time.monotonic() - started
            log(f"fuzz: {elapsed:.0f} s, {figures.sessions} sessions, {figures.messages} messages")
            if limit is not None or time.monotonic() >= end or figures.crashes:
                break
    finally:
        bystander.stop.set()
        bystander.join(config.deadline_s * 3)
        campaign.close()
        figures.serving &= health()
        after = internal_refusals()
        figures.server_internal = None if before is None or after is None else after - before
        probe.close()
    figures.seconds = time.monotonic() - started
    return figures


def start_secured(target: Path, directory: Path, *extra: str):
    """`serve` with TLS (a throwaway CA's certificate for loopback, made in `directory`) and a token file
    of a client `alice` and an admin `ops`: (the ServerProcess, its Secured)."""
    from tools.testkit.certs import make_certs
    from tools.testkit.serverproc import ServerProcess

    certs = make_certs(directory, clients=())
    secured = Secured(certs.ca().read_bytes(), secrets.token_hex(24), secrets.token_hex(24))
    tokens = directory / "tokens"
    tokens.write_text(f"alice {secured.token}\nops {secured.admin_token} admin\n")
    tokens.chmod(0o600)
    tls = ["--tls-cert", str(certs.cert("server")), "--tls-key", str(certs.key("server"))]
    server = ServerProcess(
        target,
        *tls,
        "--auth-tokens",
        str(tokens),
        *extra,
        credentials=wire.ClientCredentials(True, secured.ca),
    )
    return server, secured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--server", help="HOST:PORT of a plaintext verifier (default: start one on the demo pair)")
    p.add_argument("--target", type=Path, default=Path("models/demo/target"), help="target when starting one")
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--examples", type=int, help="exactly this many cases instead of --minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=30.0, help="every call's deadline")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument(
        "--auth",
        action="store_true",
        help="TLS and tokens: start `serve` with a throwaway certificate and token file, or with --server "
        "give --tls-ca, --token-file and --admin-token-file; fuzzed `authorization` metadata joins the cases",
    )
    p.add_argument("--tls-ca", type=Path, help="with --server --auth: the CA of its certificate")
    # Tokens come from files: a command line is readable by every local user (/proc/PID/cmdline).
    p.add_argument("--token-file", type=Path, help="with --server --auth: a file holding a client's token")
    p.add_argument(
        "--admin-token-file", type=Path, help="with --server --auth: a file with an admin's token (GetStats)"
    )
    args = p.parse_args(argv)
    if args.auth and args.server and not (args.tls_ca and args.token_file and args.admin_token_file):
        p.error("--auth with --server needs --tls-ca, --token-file and --admin-token-file")
    config = FuzzConfig(
        minutes=args.minutes, examples=args.examples, seed=args.seed, deadline_s=args.deadline_s
    )
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.server:
        secured = None
        if args.auth:
            token, admin = (f.read_text().strip() for f in (args.token_file, args.admin_token_file))
            secured = Secured(args.tls_ca.read_bytes(), token, admin)
        figures = run_campaign(args.server, config, log=log, secured=secured)
    elif args.auth:
        with tempfile.TemporaryDirectory() as directory:
            server, secured = start_secured(args.target, Path(directory))
            with server:
                figures = run_campaign(
                    server.address, config, lambda: server.proc.poll() is None, log, secured
                )
                figures.serving &= server.proc.poll() is None
    else:
        from tools.testkit.serverproc import ServerProcess

        with ServerProcess(args.target) as server:
            figures = run_campaign(server.address, config, alive=lambda: server.proc.poll() is None, log=log)
            figures.serving &= server.proc.poll() is None
    report = figures.report()
    print(json.dumps(report, indent=1) if args.json else text(report))
    return 0 if figures.clean else 1


def text(r: dict) -> str:
    statuses = ", ".join(f"{k} {v}" for k, v in r["statuses"].items())
    lines = [
        f"{r['seconds']} s: {r['messages']} messages, {r['sessions']} sessions, {r['calls']} calls",
        f"{r['opened']} sessions opened, {r['verdicts']} verdicts, {r['verified']} verified (not stale)",
        f"statuses: {statuses}",
        f"crashes {r['crashes']}, hangs {r['hangs']}, INTERNAL {r['internal']} "
        f"(ended with INTERNAL by the verifier: {r['server_internal']}); fuzzer errors {r['harness_errors']}",
        f"auth cases: {r['auth']['cases']} ({r['auth']['refused']} refused, {r['auth']['admitted']} admitted "
        f"as they had to be, {r['auth']['wrong']} wrong)",
        f"bystander: {r['bystander_runs']} runs, {r['bystander_mismatches']} mismatches, "
        f"{r['bystander_errors']} errors; SERVING throughout: {r['serving']}",
        *(f"finding: {f}" for f in r["findings"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
