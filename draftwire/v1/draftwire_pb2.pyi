from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Drafting(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTING_EDGE: _ClassVar[Drafting]
    DRAFTING_NONE: _ClassVar[Drafting]
    DRAFTING_NGRAM: _ClassVar[Drafting]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
DRAFTING_EDGE: Drafting
DRAFTING_NONE: Drafting
DRAFTING_NGRAM: Drafting
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("target_id", "vocab_size", "tokenizer_fingerprint", "max_gamma", "max_context", "special_tokens", "chat_template", "max_message_bytes", "numerics", "plain_steps", "thin_sessions", "constraints")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    THIN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_gamma: int
    max_context: int
    special_tokens: SpecialTokens
    chat_template: str
    max_message_bytes: int
    numerics: Numerics
    plain_steps: bool
    thin_sessions: bool
    constraints: bool
    def __init__(self, target_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_gamma: _Optional[int] = ..., max_context: _Optional[int] = ..., special_tokens: _Optional[_Union[SpecialTokens, _Mapping]] = ..., chat_template: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., numerics: _Optional[_Union[Numerics, _Mapping]] = ..., plain_steps: _Optional[bool] = ..., thin_sessions: _Optional[bool] = ..., constraints: _Optional[bool] = ...) -> None: ...

class Numerics(_message.Message):
    __slots__ = ("dtype", "kernels", "device", "exact", "identity")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    kernels: str
    device: str
    exact: bool
    identity: str
    def __init__(self, dtype: _Optional[str] = ..., kernels: _Optional[str] = ..., device: _Optional[str] = ..., exact: _Optional[bool] = ..., identity: _Optional[str] = ...) -> None: ...

class SpecialTokens(_message.Message):
    __slots__ = ("bos_token_id", "eos_token_ids", "pad_token_id")
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    def __init__(self, bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "stop", "tokenizer_fingerprint", "generated_token_ids", "vocab_size", "drafting", "numerics", "top_logprobs", "handoff", "constraint")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stop: StopConditions
    tokenizer_fingerprint: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    drafting: Drafting
    numerics: str
    top_logprobs: int
    handoff: bool
    constraint: Constraint
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., drafting: _Optional[_Union[Drafting, str]] = ..., numerics: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., handoff: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_object", "json_schema", "grammar", "regex")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    grammar: str
    regex: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., grammar: _Optional[str] = ..., regex: _Optional[str] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("round", "start_position", "draft_token_ids", "assumed_token_ids", "forced_indexes")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORCED_INDEXES_FIELD_NUMBER: _ClassVar[int]
    round: int
    start_position: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forced_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., start_position: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., forced_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class EdgeMessage(_message.Message):
    __slots__ = ("open", "proposal", "read")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    proposal: Proposal
    read: Read
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., read: _Optional[_Union[Read, _Mapping]] = ...) -> None: ...

class Read(_message.Message):
    __slots__ = ("committed_length",)
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    def __init__(self, committed_length: _Optional[int] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "committed_length", "reused_positions", "numerics", "read_ahead", "forward_seconds")
    class ForwardSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REUSED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_length: int
    reused_positions: int
    numerics: str
    read_ahead: int
    forward_seconds: _containers.ScalarMap[int, float]
    def __init__(self, session_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., reused_positions: _Optional[int] = ..., numerics: _Optional[str] = ..., read_ahead: _Optional[int] = ..., forward_seconds: _Optional[_Mapping[int, float]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("round", "start_position", "accepted", "target_token_id", "finish_reason", "stale", "committed_length", "target_positions", "verify_seconds", "batch_size", "server_draft_token_ids", "gamma_cap", "logprobs", "server_forced_tokens")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TARGET_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SERVER_DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_CAP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    round: int
    start_position: int
    accepted: int
    target_token_id: int
    finish_reason: FinishReason
    stale: bool
    committed_length: int
    target_positions: int
    verify_seconds: float
    batch_size: int
    server_draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    gamma_cap: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    server_forced_tokens: int
    def __init__(self, round: _Optional[int] = ..., start_position: _Optional[int] = ..., accepted: _Optional[int] = ..., target_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stale: _Optional[bool] = ..., committed_length: _Optional[int] = ..., target_positions: _Optional[int] = ..., verify_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., server_draft_token_ids: _Optional[_Iterable[int]] = ..., gamma_cap: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., server_forced_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifierMessage(_message.Message):
    __slots__ = ("opened", "verdict")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    verdict: Verdict
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("active_sessions", "sessions_opened", "rounds", "generated_tokens", "round_positions", "prefill_positions", "target_positions_per_token", "engine_batches", "engine_forwards", "engine_seconds", "reused_positions", "kept_caches", "cache_bytes", "drafts", "draft_tokens", "accepted_tokens", "accepted_per_position", "stale_proposals", "refusals", "batch_seconds_counts", "batch_size_counts", "thin_sessions", "gamma_cap", "numerics", "plain_steps", "handoffs", "forced_tokens")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPENED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUND_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_POSITIONS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REUSED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KEPT_CACHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    STALE_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SECONDS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    THIN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_CAP_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    sessions_opened: int
    rounds: int
    generated_tokens: int
    round_positions: int
    prefill_positions: int
    target_positions_per_token: float
    engine_batches: int
    engine_forwards: int
    engine_seconds: float
    reused_positions: int
    kept_caches: int
    cache_bytes: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    stale_proposals: int
    refusals: _containers.ScalarMap[str, int]
    batch_seconds_counts: _containers.RepeatedScalarFieldContainer[int]
    batch_size_counts: _containers.RepeatedScalarFieldContainer[int]
    thin_sessions: int
    gamma_cap: int
    numerics: _containers.RepeatedCompositeFieldContainer[Numerics]
    plain_steps: int
    handoffs: int
    forced_tokens: int
    def __init__(self, active_sessions: _Optional[int] = ..., sessions_opened: _Optional[int] = ..., rounds: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., round_positions: _Optional[int] = ..., prefill_positions: _Optional[int] = ..., target_positions_per_token: _Optional[float] = ..., engine_batches: _Optional[int] = ..., engine_forwards: _Optional[int] = ..., engine_seconds: _Optional[float] = ..., reused_positions: _Optional[int] = ..., kept_caches: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., stale_proposals: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ..., batch_seconds_counts: _Optional[_Iterable[int]] = ..., batch_size_counts: _Optional[_Iterable[int]] = ..., thin_sessions: _Optional[int] = ..., gamma_cap: _Optional[int] = ..., numerics: _Optional[_Iterable[_Union[Numerics, _Mapping]]] = ..., plain_steps: _Optional[int] = ..., handoffs: _Optional[int] = ..., forced_tokens: _Optional[int] = ...) -> None: ...
