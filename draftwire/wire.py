"""The wire: protobuf messages of draftwire.v1 to and from the contract's dataclasses, and the channels.

Both sides translate here and nowhere else, so no protobuf message reaches the edge's planner or the
verifier's session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from draftwire.contract import (
    Constraint,
    ConstraintKind,
    Drafting,
    Finish,
    ModelInfo,
    Numerics,
    Proposal,
    SamplingParams,
    SessionSpec,
    TargetInfo,
    TokenLogprob,
    Verdict,
)
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.vocab import Vocabulary

# The largest message either side receives by default: a prompt of ~250k ids, or a chat template.
MAX_MESSAGE_BYTES = 1 << 20
# A verifier's default takes what its target's context can hold and no more (message_bytes_for), so that
# gRPC refuses a larger message from its header, before a byte of it reaches Python.
ID_BYTES = 5  # the longest varint of a uint32 id
MESSAGE_SLACK = 64 << 10  # an open's other fields: sampling (300 logit biases at most), stop ids, names


def message_bytes_for(max_context: int) -> int:
    """The largest message a verifier of this context needs to take: an open whose prompt and generated
    ids fill the context, each id at its longest, and the open's other fields."""
    return ID_BYTES * max_context + MESSAGE_SLACK


_DRAFTING = {
    Drafting.EDGE: pb.DRAFTING_EDGE,
    Drafting.NONE: pb.DRAFTING_NONE,
    Drafting.NGRAM: pb.DRAFTING_NGRAM,
}
_DRAFTING_BACK = {v: k for k, v in _DRAFTING.items()}
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
}
_FINISH_BACK = {v: k for k, v in _FINISH.items()}


def message_size_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, max_send_bytes: int | None = None
) -> list[tuple[str, int]]:
    """gRPC options bounding the messages a server or channel receives, and sends (the same unless
    `max_send_bytes` is given)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_send_bytes or max_message_bytes),
    ]


@dataclass(frozen=True)
class ClientCredentials:
    """How a client proves who it talks to and who it is: TLS roots (PEM), a client certificate and key
    for mTLS, a token sent as `authorization: Bearer T`. Built once at the entry point."""

    tls: bool = False
    ca: bytes | None = None  # roots the server's certificate must chain to (None: the system's)
    cert_chain: bytes | None = None  # the client's certificate, for a server that requires one (mTLS)
    private_key: bytes | None = None
    token: str | None = None
    server_name: str | None = None  # the name the server's certificate must carry, if not its address

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if (self.cert_chain is not None or self.token) and not self.tls:
            # gRPC refuses call credentials on a plaintext channel: a token in clear text can be replayed.
            raise ValueError("a token or a client certificate needs TLS: give the server's CA (--tls-ca)")

    @classmethod
    def from_files(
        cls,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token: str | None = None,
    ) -> ClientCredentials:
        """TLS when any file is given. Raises OSError when a file cannot be read, ValueError as above."""
        read = lambda path: path.read_bytes() if path is not None else None  # noqa: E731
        tls = any(p is not None for p in (ca, cert, key))
        return cls(tls, read(ca), read(cert), read(key), token or None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS, with the token as call credentials. Raises ValueError without TLS."""
        if not self.tls:
            raise ValueError("plaintext: no channel credentials")
        creds = grpc.ssl_channel_credentials(self.ca, self.private_key, self.cert_chain)
        if self.token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self.token))
        return creds

    def options(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int | str]]:
        name = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*message_size_options(max_message_bytes), *name]


PLAINTEXT = ClientCredentials()


def channel(
    address: str, credentials: ClientCredentials = PLAINTEXT, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> grpc.aio.Channel:
    """An asyncio channel to a verifier (or a pool's front) at host:port: TLS when the credentials say so.
    Every client makes its channel here."""
    options = credentials.options(max_message_bytes)
    if credentials.tls:
        return grpc.aio.secure_channel(address, credentials.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def insecure_channel(address: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """A plaintext asyncio channel (loopback tests and tools)."""
    return channel(address, PLAINTEXT, max_message_bytes)


def explain(code: grpc.StatusCode, details: str, credentials: ClientCredentials) -> str:
    """A failed call's status, said for a person: what the code usually means for this client."""
    said = f"{code.name}: {details}"
    if code == grpc.StatusCode.UNAVAILABLE and not credentials.tls:
        return f"{said} (is the verifier up? if it serves TLS, give --tls-ca)"
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"{said} (is the verifier up, and does it serve TLS with a certificate from --tls-ca? if it "
            "requires client certificates, give --tls-cert and --tls-key)"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{said} (give a token the verifier knows: --token-file FILE or DRAFTWIRE_TOKEN)"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"{said} (this client's token does not allow it)"
    return said


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        seed=s.seed,
        logit_bias=dict(s.logit_bias),
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
    )


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        seed=s.seed,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
    )


def spec_to_proto(spec: SessionSpec) -> pb.OpenSession:
    return pb.OpenSession(
        prompt_token_ids=spec.prompt_token_ids,
        sampling=sampling_to_proto(spec.sampling),
        stop=pb.StopConditions(
            max_new_tokens=spec.max_new_tokens, stop_token_ids=spec.stop_token_ids, ignore_eos=spec.ignore_eos
        ),
        tokenizer_fingerprint=spec.tokenizer_fingerprint,
        vocab_size=spec.vocab_size,
        generated_token_ids=spec.generated_token_ids,
        drafting=_DRAFTING[spec.drafting],
        numerics=spec.numerics,
        top_logprobs=spec.top_logprobs,
        handoff=spec.handoff,
        constraint=constraint_to_proto(spec.constraint),
    )


def constraint_to_proto(c: Constraint | None) -> pb.Constraint | None:
    if c is None:
        return None
    if c.kind is ConstraintKind.JSON_OBJECT:
        return pb.Constraint(json_object=True)
    return pb.Constraint(**{c.kind.value: c.source})


def constraint_from_proto(m: pb.OpenSession) -> Constraint | None:
    """The open's constraint, or None when it names none (an unset oneof, or json_object false)."""
    kind = m.constraint.WhichOneof("kind") if m.HasField("constraint") else None
    if kind is None or (kind == "json_object" and not m.constraint.json_object):
        return None
    source = "" if kind == "json_object" else getattr(m.constraint, kind)
    return Constraint(ConstraintKind(kind), source)


def spec_from_proto(m: pb.OpenSession) -> SessionSpec:
    return SessionSpec(
        prompt_token_ids=tuple(m.prompt_token_ids),
        sampling=sampling_from_proto(m.sampling),
        max_new_tokens=m.stop.max_new_tokens,
        stop_token_ids=tuple(m.stop.stop_token_ids),
        ignore_eos=m.stop.ignore_eos,
        generated_token_ids=tuple(m.generated_token_ids),
        tokenizer_fingerprint=m.tokenizer_fingerprint,
        vocab_size=m.vocab_size,
        drafting=_DRAFTING_BACK.get(m.drafting, Drafting.EDGE),
        numerics=m.numerics,
        top_logprobs=m.top_logprobs if m.HasField("top_logprobs") else None,
        handoff=m.handoff,
        constraint=constraint_from_proto(m),
    )


def proposal_to_proto(p: Proposal) -> pb.Proposal:
    return pb.Proposal(
        round=p.round,
        start_position=p.start_position,
        draft_token_ids=p.draft_token_ids,
        assumed_token_ids=p.assumed_token_ids,
        forced_indexes=p.forced,
    )


def proposal_from_proto(p: pb.Proposal) -> Proposal:
    draft, assumed, forced = tuple(p.draft_token_ids), tuple(p.assumed_token_ids), tuple(p.forced_indexes)
    return Proposal(p.round, p.start_position, draft, assumed, forced)


def verdict_to_proto(v: Verdict) -> pb.Verdict:
    return pb.Verdict(
        round=v.round,
        start_position=v.start_position,
        accepted=v.accepted,
        target_token_id=v.target_token_id,
        finish_reason=_FINISH[v.finish],
        stale=v.stale,
        committed_length=v.committed_length,
        target_positions=v.target_positions,
        verify_seconds=v.verify_seconds,
        batch_size=v.batch_size,
        server_draft_token_ids=v.server_draft_token_ids,
        server_forced_tokens=v.server_forced_tokens,
        gamma_cap=v.gamma_cap,
        logprobs=[
            pb.TokenLogprob(
                logprob=t.logprob, top_token_ids=[i for i, _ in t.top], top_logprobs=[p for _, p in t.top]
            )
            for t in v.logprobs
        ],
    )


def verdict_from_proto(v: pb.Verdict) -> Verdict:
    return Verdict(
        round=v.round,
        start_position=v.start_position,
        accepted=v.accepted,
        target_token_id=v.target_token_id if v.HasField("target_token_id") else None,
        finish=_FINISH_BACK[v.finish_reason],
        stale=v.stale,
        committed_length=v.committed_length,
        target_positions=v.target_positions,
        verify_seconds=v.verify_seconds,
        batch_size=v.batch_size,
        server_draft_token_ids=tuple(v.server_draft_token_ids),
        server_forced_tokens=v.server_forced_tokens,
        gamma_cap=v.gamma_cap,
        logprobs=tuple(
            TokenLogprob(t.logprob, tuple(zip(t.top_token_ids, t.top_logprobs, strict=False)))
            for t in v.logprobs
        ),
    )


def model_info_to_proto(m: ModelInfo) -> pb.ModelInfo:
    t = m.target
    return pb.ModelInfo(
        target_id=t.target_id,
        vocab_size=t.vocabulary.size,
        tokenizer_fingerprint=t.vocabulary.fingerprint,
        max_gamma=m.max_gamma,
        max_context=t.max_context,
        special_tokens=pb.SpecialTokens(
            bos_token_id=t.bos_token_id, eos_token_ids=list(t.eos_token_ids), pad_token_id=t.pad_token_id
        ),
        chat_template=t.chat_template,
        max_message_bytes=m.max_message_bytes,
        numerics=numerics_to_proto(m.numerics) if m.numerics else None,
        plain_steps=m.plain_steps,
        thin_sessions=m.thin_sessions,
        constraints=m.constraints,
    )


def numerics_to_proto(n: Numerics) -> pb.Numerics:
    return pb.Numerics(dtype=n.dtype, kernels=n.kernels, device=n.device, exact=n.exact, identity=n.identity)


def model_info_from_proto(m: pb.ModelInfo) -> ModelInfo:
    special = m.special_tokens
    target = TargetInfo(
        target_id=m.target_id,
        vocabulary=Vocabulary(size=m.vocab_size, fingerprint=m.tokenizer_fingerprint),
        max_context=m.max_context,
        bos_token_id=special.bos_token_id if special.HasField("bos_token_id") else None,
        eos_token_ids=tuple(special.eos_token_ids),
        pad_token_id=special.pad_token_id if special.HasField("pad_token_id") else None,
        chat_template=m.chat_template,
    )
    n = m.numerics
    numerics = Numerics(n.dtype, n.kernels, n.device, n.exact) if m.HasField("numerics") else None
    return ModelInfo(
        target=target,
        max_gamma=m.max_gamma,
        max_message_bytes=m.max_message_bytes,
        numerics=numerics,
        plain_steps=m.plain_steps,
        thin_sessions=m.thin_sessions,
        constraints=m.constraints,
    )
