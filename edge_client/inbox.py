"""A Session stream's incoming side: the verdicts as they arrive, and how the edge reads the stream's
failures (VerifierError): the verifier's own refusals, and a broken transport, which a resume can cure.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from draftwire import wire
from draftwire.aio import within
from draftwire.contract import Verdict
from edge_client.adaptive import Tuner
from edge_client.planner import BadVerdict, GenerationStats, check_logprobs


class VerifierError(Exception):
    """The verifier ended the session with a non-OK status (or the edge gave up on it)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


# What the gRPC core (not the verifier) reports when the connection breaks under a write; the
# verifier's own INTERNAL statuses say "verifier error: ...".
CORE_INTERNAL = "Internal error from Core"
# And when the connection's bytes go bad (TLS fails a record's check: TSI_DATA_CORRUPTED) or it is torn
# down under a stream; the verifier never answers UNKNOWN itself.
STREAM_REMOVED = "Stream removed"


def as_verifier_error(error: VerifierError | grpc.aio.AioRpcError) -> VerifierError:
    """An error of a stream as the generation loop takes it; an AioRpcError is the model info's, asked
    before an open (before_open)."""
    if isinstance(error, VerifierError):
        return error
    return before_open(VerifierError(error.code(), error.details() or ""))


def before_open(error: VerifierError) -> VerifierError:
    """An error before a session opened as the generation loop takes it: a deadline missed then (the
    model info's or the open's: a frozen or overloaded verifier) is the UNAVAILABLE the edge resumes
    after, within its resume budget, as after a broken stream."""
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return VerifierError(grpc.StatusCode.UNAVAILABLE, f"no answer in time: {error.details}")
    return error


def stream_broke(error: VerifierError) -> VerifierError:
    """A transport failure as the UNAVAILABLE the edge resumes after."""
    return VerifierError(grpc.StatusCode.UNAVAILABLE, f"the stream broke: {error}")


def broken_transport(error: VerifierError) -> bool:
    """The gRPC core's own status for a connection that broke, not one the verifier chose."""
    return (error.code == grpc.StatusCode.INTERNAL and error.details == CORE_INTERNAL) or (
        error.code == grpc.StatusCode.UNKNOWN and error.details.startswith(STREAM_REMOVED)
    )


def bad_thin_verdict(verdict: Verdict, vocab_size: int, top_logprobs: int | None) -> str | None:
    """What is wrong with a thin session's verdict (ids outside the vocabulary, no progress, logprobs
    not as asked), or None."""
    ids = verdict.thin_committed
    if any(not 0 <= t < vocab_size for t in ids) or verdict.accepted > len(verdict.server_draft_token_ids):
        return f"round {verdict.round}: ids outside the vocabulary of {vocab_size}"
    if not ids and verdict.finish is None:
        return f"round {verdict.round} commits nothing and does not finish"
    try:
        check_logprobs(verdict, len(ids), top_logprobs, vocab_size)
    except BadVerdict as e:
        return str(e)
    return None


class Inbox:
    """The verdicts of a stream as they arrive, read by a task of its own; then the stream's end or
    failure, as a VerifierError."""

    def __init__(self, call, stats: GenerationStats, tuner: Tuner):
        self.opened = False  # the verifier answered the open message
        self.tuner = tuner  # told the verifier's forward costs the open carries
        self.read_ahead = 0  # a thin session: tokens the verifier decodes past the last Read (0: no Reads)
        self.arrived: dict[int, float] = {}  # round -> when its verdict arrived (perf_counter)
        self.stats = stats
        self._queue: asyncio.Queue[Verdict | VerifierError] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read(call))

    def get_nowait(self) -> Verdict | None:
        """The next verdict if one has arrived, else None; raises the stream's error in its turn."""
        return None if self._queue.empty() else self._take(self._queue.get_nowait())

    async def get(self, timeout_s: float | None = None) -> Verdict:
        """The next verdict; raises VerifierError UNAVAILABLE when none comes within `timeout_s` (a hung
        verifier: the generation resumes elsewhere)."""
        try:
            item = await within(self._queue.get(), timeout_s)
        except TimeoutError:
            raise VerifierError(
                grpc.StatusCode.UNAVAILABLE, f"no verdict from the verifier within {timeout_s:g} s"
            ) from None
        return self._take(item)

    def close(self) -> None:
        self._reader.cancel()

    @staticmethod
    def _take(item: Verdict | VerifierError) -> Verdict:
        if isinstance(item, VerifierError):
            raise item
        return item

    async def _read(self, call) -> None:
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise VerifierError(grpc.StatusCode.UNAVAILABLE, "the verifier closed the session early")
                kind = message.WhichOneof("kind")
                if kind == "verdict":
                    self.stats.wire_bytes += message.verdict.ByteSize()
                    verdict = wire.verdict_from_proto(message.verdict)
                    self.arrived[verdict.round] = time.perf_counter()
                    self._queue.put_nowait(verdict)
                elif kind == "opened":
                    self.opened = True
                    self.read_ahead = message.opened.read_ahead
                    self.stats.reused_positions = message.opened.reused_positions
                    self.stats.numerics = self.stats.numerics or message.opened.numerics
                    self.tuner.observe_server_costs(message.opened.forward_seconds)
        except grpc.aio.AioRpcError as e:
            self._queue.put_nowait(VerifierError(e.code(), e.details() or ""))
        except VerifierError as e:
            self._queue.put_nowait(e)
