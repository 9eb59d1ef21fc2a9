"""The fault campaign (issue 15 item 6) on real processes with the demo pair: a verifier restarted on
the same address, a pool's front restarted on its address (`serve --ray`, whose driver process is the
front, SIGKILLed mid-generation), a client that disconnects mid-round, a stalled network, a client that
stops reading verdicts. Each ends with the edge's committed tokens equal to an undisturbed run (none
lost, none repeated) and the verifier's sessions, KV cache and RSS back where they were. A replica
killed mid-round and a draining pool are in test_cluster.py; a dropped connection in test_netdelay.py."""

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, Timeouts
from tools.rig.netdelay import DelayConfig, DelayProxy
from tools.rig.serverproc import ServerProcess
from tools.testkit.fakes import Paced

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
PROMPT = (5, 60, 70, 80)
NEW = 40
RSS_SLACK_MB = 100  # what a verifier's RSS may gain over a fault, once warm
PATIENT = Timeouts()  # the edge's defaults


def serve(*extra: str, timeout: float = 120) -> ServerProcess:
    """The demo target in its default (bit-exact) mode; no kept caches, so a freed cache is gone."""
    return ServerProcess(DEMO / "target", "--prefix-cache-mb", "0", *extra, timeout=timeout)


def request() -> GenerationRequest:
    return GenerationRequest(PROMPT, max_new_tokens=NEW, gamma=3, ignore_eos=True)


async def stats(address: str) -> pb.ServerStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest(), timeout=10)


async def settled(address: str, timeout_s: float = 15) -> pb.ServerStats:
    """The verifier's stats once no session is active (or when `timeout_s` runs out)."""
    deadline = time.monotonic() + timeout_s
    while (now := await stats(address)).active_sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return now


def descendants(pid: int) -> dict[int, int]:
    """The processes below `pid` now (its children, theirs, ...), each with its start time, which tells
    a process from a later one given the same id."""
    parents, started = {}, {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            parents[int(entry.name)], started[int(entry.name)] = int(fields[1]), int(fields[19])
    found, below = {}, [pid]
    while below:
        parent = below.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = started[child]
                below.append(child)
    return found


def still_running(processes: dict[int, int]) -> list[int]:
    """Those of `processes` (id: start time) that run yet."""
    alive = []
    for pid, started in processes.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[19]) == started and fields[0] != "Z":
            alive.append(pid)
    return alive


async def accepts(address: str) -> float:
    """When (time.monotonic) a TCP connection to `address` first succeeds."""
    host, port = address.rsplit(":", 1)
    while True:
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return time.monotonic()


def rss_mb(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


async def generate(address, drafter, timeouts=PATIENT, ids=None, stats_=None) -> list[int]:
    ids = ids if ids is not None else []
    async with grpc.aio.insecure_channel(address) as channel:
        async for _ in EdgeSession(channel, drafter, timeouts).generate(request(), stats_, ids):
            pass
    return ids


async def committed_at_least(ids: list[int], n: int) -> None:
    while len(ids) < n:
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def drafter():
    return LlamaDrafter(DrafterConfig(DEMO / "draft-q8_0.gguf", n_ctx=512))


@pytest.fixture(scope="module")
def verifier():
    with serve() as server:
        yield server


@pytest.fixture(scope="module")
def expected(verifier, drafter) -> list[int]:
    """An undisturbed run (it also warms the verifier, so the baselines below are warm)."""
    ids = asyncio.run(generate(verifier.address, drafter))
    assert len(ids) == NEW
    return ids


@pytest.fixture()
def baseline(verifier, expected):
    """The shared verifier's stats and RSS before a fault; checks they come back after it."""
    before, rss = asyncio.run(settled(verifier.address)), rss_mb(verifier)
    assert before.active_sessions == 0
    yield
    after = asyncio.run(settled(verifier.address))
    assert after.active_sessions == 0 and after.cache_bytes == before.cache_bytes
    assert rss_mb(verifier) < rss + RSS_SLACK_MB, (rss, rss_mb(verifier))


def test_verifier_restarted_on_the_same_address_the_edge_resumes_exactly(drafter, expected):
    first, second = serve(), None
    port = first.address.rsplit(":", 1)[1]
    ids, gen_stats = [], GenerationStats()
    timeouts = Timeouts(verdict_s=10, resume_s=60, backoff_s=0.1, max_backoff_s=1.0)

    async def scenario():
        nonlocal second
        task = asyncio.create_task(generate(first.address, Paced(drafter, 0.05), timeouts, ids, gen_stats))
        await committed_at_least(ids, 4)
        first.proc.kill()  # SIGKILL: no drain, the stream just breaks
        first.proc.wait()
        killed_at = len(ids)
        await asyncio.sleep(1)
        second = await asyncio.to_thread(serve, "--port", port)
        await task
        return killed_at, await settled(second.address)

    try:
        killed_at, after = asyncio.run(scenario())
        assert second.address == first.address
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert 4 <= killed_at < NEW
    assert ids == expected  # every committed token kept, none repeated
    assert gen_stats.resumes >= 1
    assert after.sessions_opened == 1 and after.active_sessions == 0 and after.cache_bytes == 0


POOL = ("--ray", "--replicas", "1", "--replica-cpus", "0.5", "--replica-host", "127.0.0.1")


def test_pool_restarted_on_the_same_port_the_edge_resumes_exactly(drafter, expected, monkeypatch):
    """`serve --ray` runs the front in the pool's driver process, which also started the pool's local Ray
    cluster: a SIGKILL takes the front, the pool and its replica down at once. Started again on the same
    port while an edge with the default Timeouts generates, it serves a new pool, and the edge resumes to
    exactly the undisturbed tokens. Two processes of the killed cluster outlive it by about a minute
    (Ray's DashboardAgent and RuntimeEnvAgent, docs/cluster.md, Limits): the new pool starts beside
    them, and the test ends them."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a private loopback cluster; see docs/cluster.md
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # no --address and no RAY_ADDRESS: a local cluster
    first, second, killed = serve(*POOL, timeout=240), None, {}
    port = first.address.rsplit(":", 1)[1]
    ids, gen_stats = [], GenerationStats()

    async def scenario():
        nonlocal second, killed
        task = asyncio.create_task(generate(first.address, Paced(drafter, 0.05), PATIENT, ids, gen_stats))
        await committed_at_least(ids, 4)
        killed = descendants(first.proc.pid)  # Ray's processes, the replica's among them
        first.proc.kill()  # SIGKILL: no drain, no ray.shutdown
        first.proc.wait()
        killed_at, down = len(ids), time.monotonic()
        listening = asyncio.create_task(accepts(first.address))
        second = await asyncio.to_thread(serve, *POOL, "--port", port, timeout=240)
        back = time.monotonic() - down
        await task
        return killed_at, (await listening) - down, back, still_running(killed)

    try:
        killed_at, listening, back, lingering = asyncio.run(scenario())
        assert second.address == first.address
    finally:
        first.stop()
        if second is not None:
            second.stop()
        for pid in still_running(killed):
            os.kill(pid, signal.SIGKILL)
    assert 4 <= killed_at < NEW
    assert ids == expected  # every committed token kept, none repeated
    assert gen_stats.resumes >= 1
    print(
        f"after the kill: the front listened in {listening:.1f} s, the pool served in {back:.1f} s; "
        f"{len(lingering)} of the killed pool's processes ran yet"
    )


def test_client_disconnects_mid_round_the_server_frees_it_and_others_are_untouched(
    verifier, drafter, expected, baseline
):
    async def scenario():
        # A drafter of its own: one llama.cpp context must not draft for two sessions at once.
        own = LlamaDrafter(DrafterConfig(DEMO / "draft-q8_0.gguf", n_ctx=512))
        bystander = asyncio.create_task(generate(verifier.address, Paced(own, 0.02)))
        cut_short = []
        for chunks in (1, 2, 5):
            ids = []
            async with grpc.aio.insecure_channel(verifier.address) as channel:
                stream = EdgeSession(channel, drafter).generate(request(), None, ids)
                async for _ in stream:
                    chunks -= 1
                    if chunks == 0:
                        # The next proposal already left (pipelining): closing cancels the stream mid-round.
                        await stream.aclose()
                        break
            cut_short.append(ids)
        during = await stats(verifier.address)
        return await bystander, cut_short, during

    bystander, cut_short, during = asyncio.run(scenario())
    assert bystander == expected
    for ids in cut_short:
        assert 0 < len(ids) < NEW and ids == expected[: len(ids)]
    assert during.active_sessions <= 2  # the bystander, and at most one cancelled stream not yet freed


def test_stalled_network_the_edge_times_out_and_resumes_exactly(verifier, drafter, expected, baseline):
    host, port = verifier.address.rsplit(":", 1)
    ids, gen_stats = [], GenerationStats()
    timeouts = Timeouts(verdict_s=1.0, resume_s=30, backoff_s=0.1, max_backoff_s=0.5)

    async def scenario():
        async with DelayProxy(DelayConfig(host, int(port), 0.002)) as proxy:
            task = asyncio.create_task(
                generate(proxy.address, Paced(drafter, 0.02), timeouts, ids, gen_stats)
            )
            await committed_at_least(ids, 4)
            proxy.stall()
            stalled_at = len(ids)
            await asyncio.sleep(2.5)  # past the verdict deadline: the edge re-opens into the stall
            during = len(ids), gen_stats.resumes
            proxy.resume()
            await task
            return stalled_at, during

    stalled_at, (committed_during, resumes_during) = asyncio.run(scenario())
    assert committed_during <= stalled_at + 4  # at most what was already on its way
    assert resumes_during >= 1
    assert ids == expected


def test_client_that_stops_reading_verdicts_is_ended_at_the_idle_timeout(drafter):
    """A client floods stale proposals (the cheapest verdicts) and never reads a verdict. Its receive
    window (64 KiB: no BDP probing) fills, the verifier's write is held by flow control, and it stops
    reading proposals (what it does not read waits in gRPC's own flow-control window, bounded); the
    held write ends the session at the idle timeout with DEADLINE_EXCEEDED and frees its cache.
    (Before, a held write kept the session, past the idle timeout and the drain, until its maximum
    age.)"""
    idle_s, flood_s = 2.0, 4.0
    server = serve("--idle-timeout-s", str(idle_s), "--max-stale-in-a-row", "1000000000")
    stop = pb.StopConditions(max_new_tokens=NEW, ignore_eos=True)
    open_msg = pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=PROMPT, stop=stop))

    def stale(round_no: int) -> pb.EdgeMessage:
        # Assumes a last committed token other than the prompt's: answered stale, no forward pass.
        proposal = pb.Proposal(
            round=round_no, start_position=len(PROMPT), draft_token_ids=[1, 2], assumed_token_ids=[81]
        )
        return pb.EdgeMessage(proposal=proposal)

    async def scenario():
        warm = await generate(server.address, drafter)  # the forward paths, warm
        base, rss = await settled(server.address), rss_mb(server)
        # No BDP probing: the client's receive window stays at 64 KiB, so unread verdicts fill it soon.
        async with grpc.aio.insecure_channel(
            server.address, options=[("grpc.http2.bdp_probe", 0)]
        ) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg)
            assert (await call.read()).WhichOneof("kind") == "opened"
            sent, peak, start = 0, rss, time.monotonic()
            while time.monotonic() - start < flood_s:
                try:
                    await asyncio.wait_for(call.write(stale(sent + 1)), 1)
                except TimeoutError:
                    break  # flow control: the verifier's window is full (its backlog is bounded)
                sent += 1
                if sent % 2000 == 0:
                    peak = max(peak, rss_mb(server))
            while (now := await stats(server.address)).active_sessions:
                peak = max(peak, rss_mb(server))
                assert time.monotonic() - start < 30, (sent, now.stale_proposals)
                await asyncio.sleep(0.2)

            # What the client finds when it reads again: the verdicts it left, then the status.
            async def read_to_the_end():
                while await call.read() is not grpc.aio.EOF:
                    pass

            try:
                await asyncio.wait_for(read_to_the_end(), 10)
            except grpc.aio.AioRpcError:
                pass
            ended = call.code() if call.done() else None
            ended = await ended if ended is not None else None
        return warm, base, rss, sent, peak, now, ended

    try:
        warm, base, rss, sent, peak, after, ended = asyncio.run(scenario())
        rss_after = rss_mb(server)
    finally:
        server.stop()
    assert len(warm) == NEW
    # The verifier stopped taking proposals once its verdicts went unread, and ended the session.
    assert 0 < after.stale_proposals - base.stale_proposals < sent
    assert ended == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after.active_sessions == 0 and after.cache_bytes == base.cache_bytes
    assert peak < rss + RSS_SLACK_MB and rss_after < rss + RSS_SLACK_MB, (rss, peak, rss_after)
