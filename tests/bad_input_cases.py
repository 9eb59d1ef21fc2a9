"""Bad input for a Verifier's Session stream, each with the status and words it must get, and the small
clients the limit tests use: shared by the in-process checks over the fake engine (tests/wire) and those
against a real `serve` in a subprocess (tests/system)."""

import asyncio
import math

import grpc
import pytest

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

PROMPT = [5, 60, 70, 80]


def open_msg(
    info, prompt=PROMPT, max_new=16, fingerprint=None, top_logprobs=None, **sampling
) -> pb.EdgeMessage:
    return pb.EdgeMessage(
        open=pb.OpenSession(
            top_logprobs=top_logprobs,
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(**sampling),
            stop=pb.StopConditions(max_new_tokens=max_new, ignore_eos=True),
            tokenizer_fingerprint=info.tokenizer_fingerprint if fingerprint is None else fingerprint,
            vocab_size=info.vocab_size,
        )
    )


def proposal(round_no, start, draft, assumed=()) -> pb.EdgeMessage:
    return pb.EdgeMessage(
        proposal=pb.Proposal(
            round=round_no, start_position=start, draft_token_ids=draft, assumed_token_ids=assumed
        )
    )


async def exchange(address: str, messages: list[pb.EdgeMessage]) -> tuple[list, grpc.aio.AioRpcError | None]:
    """Sends the messages, half-closes, and collects the replies until the stream ends."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.VerifierStub(channel).Session(iter(messages))
        replies = []
        try:
            async for reply in call:
                replies.append(reply)
        except grpc.aio.AioRpcError as e:
            return replies, e
        return replies, None


def refused(address, messages, code, pattern):
    replies, error = asyncio.run(exchange(address, messages))
    assert error is not None, f"expected {code.name}, got replies {replies}"
    assert error.code() == code, error.details()
    assert pattern.lower() in error.details().lower(), error.details()
    return replies


START = len(PROMPT)  # start position of the first proposal


CASES = [
    pytest.param(lambda i: [open_msg(i, prompt=[])], INVALID, "prompt is empty", id="empty prompt"),
    pytest.param(
        lambda i: [open_msg(i, prompt=[1, 10**6])], INVALID, "outside the vocabulary", id="prompt id"
    ),
    pytest.param(lambda i: [open_msg(i, max_new=600)], INVALID, "exceeds the target's context", id="context"),
    pytest.param(
        lambda i: [open_msg(i, temperature=-1.0)], INVALID, "temperature", id="negative temperature"
    ),
    pytest.param(lambda i: [open_msg(i, temperature=math.nan)], INVALID, "temperature", id="nan temperature"),
    pytest.param(lambda i: [open_msg(i, temperature=math.inf)], INVALID, "temperature", id="inf temperature"),
    pytest.param(lambda i: [open_msg(i, temperature=1.0, top_p=0.0)], INVALID, "top_p", id="top-p 0"),
    pytest.param(lambda i: [open_msg(i, temperature=1.0, top_p=1.5)], INVALID, "top_p", id="top-p 1.5"),
    pytest.param(
        lambda i: [open_msg(i, frequency_penalty=2.5)], INVALID, "frequency_penalty", id="frequency penalty"
    ),
    pytest.param(
        lambda i: [open_msg(i, presence_penalty=-3.0)], INVALID, "presence_penalty", id="presence penalty"
    ),
    pytest.param(
        lambda i: [open_msg(i, repetition_penalty=0.0)], INVALID, "repetition_penalty", id="repetition 0"
    ),
    pytest.param(lambda i: [open_msg(i, logit_bias={5: 200.0})], INVALID, "logit_bias", id="bias range"),
    pytest.param(
        lambda i: [open_msg(i, logit_bias={10**6: 1.0})], INVALID, "logit_bias token id", id="bias id"
    ),
    pytest.param(lambda i: [open_msg(i, top_logprobs=21)], INVALID, "top_logprobs", id="top logprobs"),
    pytest.param(lambda i: [proposal(1, 4, [1])], INVALID, "first message", id="proposal before open"),
    pytest.param(lambda i: [open_msg(i), open_msg(i)], INVALID, "already open", id="second open"),
    pytest.param(lambda i: [open_msg(i), proposal(2, START, [1])], INVALID, "out of order", id="round gap"),
    pytest.param(
        lambda i: [open_msg(i), proposal(1, START, [1]), proposal(1, START, [1])],
        INVALID,
        "out of order",
        id="repeat",
    ),
    pytest.param(
        lambda i: [open_msg(i), proposal(1, START, [1] * 9)], INVALID, "gamma 9", id="gamma over max"
    ),
    pytest.param(
        lambda i: [open_msg(i), proposal(1, START, [1, 99999])],
        INVALID,
        "outside the vocabulary",
        id="draft id",
    ),
    pytest.param(
        lambda i: [open_msg(i), proposal(1, START, [1], assumed=[80, 99999])],
        INVALID,
        "outside the vocabulary",
        id="assumed id",
    ),
    pytest.param(
        lambda i: [open_msg(i), proposal(1, START, [1], assumed=[80] * 10)],
        INVALID,
        "assumed tokens",
        id="assumed over max",
    ),
    pytest.param(
        lambda i: [open_msg(i, max_new=1), proposal(1, START, [1]), proposal(2, START + 1, [1])],
        PRECONDITION,
        "finished",
        id="proposal after finish",
    ),
]


def plain_open(max_new: int = 16, stop=()) -> pb.EdgeMessage:
    """An open of PROMPT, greedy, `max_new` tokens, EOS ignored."""
    stop_conditions = pb.StopConditions(max_new_tokens=max_new, ignore_eos=True, stop_token_ids=stop)
    return pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=PROMPT, stop=stop_conditions))


async def opened(channel, max_new: int = 16):
    """A session opened and held (its call), or the AioRpcError of its refusal."""
    call = pb_grpc.VerifierStub(channel).Session()
    await call.write(plain_open(max_new))
    try:
        assert (await call.read()).WhichOneof("kind") == "opened"
    except grpc.aio.AioRpcError as e:
        return e
    return call


def retry_hint(error: grpc.aio.AioRpcError) -> int:
    """The `retry-after-ms` a RESOURCE_EXHAUSTED refusal carries."""
    return int(dict(error.trailing_metadata())["retry-after-ms"])
