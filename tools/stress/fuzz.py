"""`python -m tools.stress.fuzz`: a fuzz campaign on the verifier's wire surface, driven by hypothesis.

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
import collections
import json
import secrets
import sys
import tempfile
import threading
import time
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
from tools.stress.fuzzcases import HEALTH, SERVICE, Secured, State, auth_cases, cases, sendable
from tools.stress.rawwire import header_bytes, raw_call

# The servers the campaign starts parse every case: a client's refused opens do not get its next ones
# refused unread (--max-refused-opens-per-s), which would stop the cases before the parser.
DEEP = ("--max-refused-opens-per-s", "0")
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
            # waits for its deadline. The client's wait, not the verifier's (docs/runs/fuzz.md).
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
        headers = [header_bytes(k, v) for k, v in metadata]
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
        elif expected == c.OK and code == c.RESOURCE_EXHAUSTED and "retry after" in self._last_details:
            f.auth_admitted += 1  # authenticated, then refused for room (a KV share, a full verifier)
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
    from tools.rig.certs import make_certs
    from tools.rig.serverproc import ServerProcess

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
        *DEEP,
        *extra,
        credentials=wire.ClientCredentials(True, secured.ca),
    )
    return server, secured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.stress.fuzz", description=__doc__.splitlines()[0])
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
        from tools.rig.serverproc import ServerProcess

        with ServerProcess(args.target, *DEEP) as server:
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
