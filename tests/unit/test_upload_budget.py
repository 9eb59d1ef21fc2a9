"""≤ 1 KB upload per round at γ = 8 (issue 14): a proposal as the edge builds it, framed as gRPC sends it
(the serialized EdgeMessage and gRPC's 5-byte prefix), stays within 1024 bytes, with its ids and numbers
at the largest the contract allows and every field set.

The messages are the edge's own: a real EdgeSession (planner, wire conversion, the stub's serializer) runs
a pipelined γ = 8 generation against an in-process fake of the Session call, whose verifier is the planner
tests' FakeVerifier; the drafter proposes the largest id the vocabulary allows. The bytes the fake
receives are what the stub's request serializer gives gRPC to frame."""

import asyncio

from draftwire import wire
from draftwire.contract import ModelInfo, SamplingParams
from draftwire.v1 import draftwire_pb2 as pb
from edge_client.planner import DraftTokens
from edge_client.session import EdgeSession, GenerationRequest
from tools.bench.upload import BUDGET, GRPC_PREFIX, UINT32_MAX, UINT64_MAX, frame_bytes, worst_case
from tools.testkit.fakes import FakeVerifier, fake_info
from verifier_service.session import VerifierLimits

GAMMA = 8
VOCAB = UINT32_MAX  # the largest vocabulary ModelInfo can name (uint32): ids up to 2^32 - 2


class LargestIds:
    """Drafts the largest id of the vocabulary at every position (the fake target rejects them)."""

    executor = None

    def __init__(self, vocabulary):
        self.vocabulary = vocabulary

    def propose(self, sequence, gamma, params, stop_token_ids=(), prompt_length=0):
        # The last one as a constraint's forced token: the proposal then names it (forced_indexes)
        return DraftTokens([self.vocabulary.size - 1] * gamma, forced=[gamma - 1])


class FakeSessionCall:
    """A Session stream in process: what the edge writes goes through the stub's serializer (the bytes gRPC
    frames), is parsed back and answered by a FakeVerifier."""

    def __init__(self, serialize, deserialize, sent: list[bytes]):
        self.serialize, self.deserialize, self.sent = serialize, deserialize, sent
        self.replies: asyncio.Queue = asyncio.Queue()
        self.verifier: FakeVerifier | None = None

    async def write(self, message) -> None:
        data = self.serialize(message)
        self.sent.append(data)
        received = pb.EdgeMessage.FromString(data)
        if received.WhichOneof("kind") == "open":
            self.verifier = FakeVerifier(wire.spec_from_proto(received.open))
            reply = pb.VerifierMessage(opened=pb.SessionOpened(session_id="s", committed_length=0))
        else:
            verdict = self.verifier.answer(wire.proposal_from_proto(received.proposal))
            reply = pb.VerifierMessage(verdict=wire.verdict_to_proto(verdict))
        # Queued without yielding: the edge reads it once it waits, as if the verdict were on its way.
        self.replies.put_nowait(self.deserialize(reply.SerializeToString()))

    async def read(self):
        return await self.replies.get()

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        return True


class FakeChannel:
    """Enough of grpc.aio.Channel for VerifierStub: GetModelInfo and Session, in process."""

    def __init__(self, info: ModelInfo):
        self.info, self.sent = info, []

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **_):
        async def call(request, timeout=None):
            assert method.endswith("/GetModelInfo"), method
            return response_deserializer(wire.model_info_to_proto(self.info).SerializeToString())

        return call

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **_):
        return lambda timeout=None: FakeSessionCall(request_serializer, response_deserializer, self.sent)


def _edge_messages(sampling: SamplingParams) -> list[pb.EdgeMessage]:
    target = fake_info(VOCAB)
    channel = FakeChannel(ModelInfo(target, VerifierLimits().max_gamma, wire.MAX_MESSAGE_BYTES))
    session = EdgeSession(channel, LargestIds(target.vocabulary))
    request = GenerationRequest(tuple(range(2, 12)), sampling, 48, gamma=GAMMA, ignore_eos=True, pipeline=2)
    ids, stats = asyncio.run(session.run(request))
    assert len(ids) == 48 and stats.rounds > 0
    return [pb.EdgeMessage.FromString(data) for data in channel.sent]


def test_a_gamma_8_proposal_frame_fits_in_1_kb_whatever_its_numbers():
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, seed=UINT64_MAX)):
        messages = _edge_messages(sampling)
        proposals = [m for m in messages if m.WhichOneof("kind") == "proposal"]
        assert proposals and all(frame_bytes(m) <= BUDGET for m in proposals)
        assert max(len(m.proposal.draft_token_ids) for m in proposals) == GAMMA
        # Every field the contract gives a proposal is set in the largest one the edge sent (pipelined:
        # it carries an assumed token); a field added to Proposal fails here until it is sized.
        largest = max(proposals, key=frame_bytes)
        fields = {f.name for f, _ in largest.proposal.ListFields()}
        assert fields == {f.name for f in pb.Proposal.DESCRIPTOR.fields}, fields
        assert len(largest.proposal.draft_token_ids) == GAMMA
        assert list(largest.proposal.draft_token_ids) == [VOCAB - 1] * GAMMA

        # Its numbers at the contract's largest: round and start 2^64 - 1, ids 2^32 - 1.
        edge_worst = worst_case(largest)
        assert edge_worst.proposal.round == UINT64_MAX
        assert len(edge_worst.proposal.assumed_token_ids) == len(largest.proposal.assumed_token_ids)
        assert frame_bytes(edge_worst) <= BUDGET
        # The contract's worst (what a verifier with serve's default max_gamma accepts): max_gamma + 1
        # assumed ids, though the edge sends one.
        contract_worst = worst_case(largest, assumed=VerifierLimits().max_gamma + 1)
        assert frame_bytes(contract_worst) <= BUDGET


def test_frame_bytes_is_the_serialized_message_and_grpc_prefix():
    message = pb.EdgeMessage(proposal=pb.Proposal(round=1, start_position=3, draft_token_ids=[5, 6]))
    assert frame_bytes(message) == len(message.SerializeToString()) + GRPC_PREFIX == 15
