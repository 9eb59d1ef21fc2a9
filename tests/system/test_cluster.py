"""The verifier pool on a real local Ray cluster: exact output through the front, routing, a real kill of a
replica's process mid-generation, draining, autoscaling, placement on GPUs.

Ray starts once for the module (token authentication off: a private loopback cluster that dies with
the module). It declares two GPUs this machine does not have: Ray places replicas that ask for GPUs on
them as it would on real ones, and torch in those replicas, seeing none, runs on the CPU. The front, the
pool and the edge sessions share one event loop in a background thread.
"""

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.config import PoolConfig, ReplicaConfig, ScalingConfig
from cluster.front import Front
from cluster.pool import Pool
from cluster.routing import State
from draftwire.contract import SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats
from tools.rig.localray import local_ray
from tools.testkit.fakes import Paced
from verifier_service.admission import AdmissionConfig
from verifier_service.auth import Identity
from verifier_service.engine import TargetEngine, model_name
from verifier_service.servicer import ServerConfig
from verifier_service.session import VerifierLimits, reference_decode

ray = pytest.importorskip("ray")

GPUS = 2  # declared by the module's cluster, not present
PROMPTS = [tuple((11 + 29 * p + 13 * i) % 400 + 20 for i in range(12 + p)) for p in range(4)]


class LoopThread:
    """An event loop in a thread: the pool and its front live there for the whole module."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(num_cpus=4, num_gpus=GPUS):
        yield


@pytest.fixture(scope="module")
def loop(ray_cluster):
    thread = LoopThread()
    yield thread
    thread.close()


def pool_config(
    test_pair, scaling: ScalingConfig, admission: AdmissionConfig | None = None, gpus: float | None = 0.0
) -> PoolConfig:
    """A pool of replicas of half a CPU each and `gpus` GPUs (default none: the module's pools share
    the cluster, and its two GPUs go to the test of placement; None: placed by the cluster)."""
    limits = VerifierLimits(max_gamma=8)
    server = ServerConfig(host="127.0.0.1", port=0, limits=limits, admission=admission or AdmissionConfig())
    return PoolConfig(
        replica=ReplicaConfig(test_pair.target_dir, server, num_cpus=0.5, num_gpus=gpus),
        scaling=scaling,
        front=ServerConfig(host="127.0.0.1", port=0),
        open_timeout_s=60,
    )


async def start_pool(config: PoolConfig) -> tuple[Pool, Front, str]:
    pool = Pool(config)
    await pool.start()
    front = Front(pool, config.front)
    port = await front.start()
    return pool, front, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def pool(loop, test_pair):
    """Two replicas, a fixed pool."""
    config = pool_config(test_pair, ScalingConfig(min_replicas=2, max_replicas=2, interval_s=0.5))
    pool, front, address = loop.run(start_pool(config), timeout=180)
    pool.address = address
    yield pool
    loop.run(front.stop(0))
    loop.run(pool.close())


@pytest.fixture(scope="module")
def engine(test_pair):
    return TargetEngine.load(test_pair.target_dir)


def expected(engine, prompt, new_tokens: int) -> list[int]:
    return reference_decode(engine, SessionSpec(prompt, max_new_tokens=new_tokens, ignore_eos=True))


def request(prompt, new_tokens: int, gamma: int = 4) -> GenerationRequest:
    return GenerationRequest(prompt, max_new_tokens=new_tokens, gamma=gamma, ignore_eos=True)


def replay(engine, prompt, new_tokens, delay_s=0.0, seed=0):
    """A cheap drafter: the target's own continuation with 30% of the draft tokens corrupted."""
    script = (*prompt, *expected(engine, prompt, new_tokens))
    drafter = ReplayDrafter(script, engine.info.vocabulary, corrupt=0.3, seed=seed)
    return Paced(drafter, delay_s) if delay_s else drafter


async def run_once(channel, engine, prompt, new_tokens: int, seed: int = 0):
    session = EdgeSession(channel, replay(engine, prompt, new_tokens, seed=seed))
    return await session.run(request(prompt, new_tokens))


def generation(channel, engine, prompt, new_tokens: int, seed: int):
    """A paced generation (gamma 2) started as a task: (task, committed ids as they come, stats)."""
    committed, stats = [], GenerationStats()
    session = EdgeSession(channel, replay(engine, prompt, new_tokens, delay_s=0.01, seed=seed))

    async def run():
        async for _ in session.generate(request(prompt, new_tokens, gamma=2), stats, committed):
            pass

    return asyncio.get_running_loop().create_task(run()), committed, stats


async def replica_stats(pool: Pool) -> dict[str, pb.ServerStats]:
    out = {}
    for name, info in pool.info.items():
        async with grpc.aio.insecure_channel(info.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            out[name] = await stub.GetStats(pb.StatsRequest(), metadata=as_the_front(pool))
    return out


def as_the_front(pool: Pool):
    """Replicas admit only the front (the pool's secret): a test calls them as the front does."""
    return pool.hop_metadata(Identity("test", admin=True))


async def held(channel, prompt, metadata=()):
    """A session opened and left waiting (the call); the AioRpcError when it is refused."""
    call = pb_grpc.VerifierStub(channel).Session(metadata=metadata)
    await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt)))
    try:
        assert (await call.read()).WhichOneof("kind") == "opened"
    except grpc.aio.AioRpcError as e:
        return e
    return call


def live(n: int):
    return lambda p: len(p.table.of(State.LIVE)) == n and len(p.table.slots) == n


def test_pool_serves_exactly_what_the_target_writes(pool, loop, engine, test_pair):
    async def scenario():
        async with grpc.aio.insecure_channel(pool.address) as channel:
            runs = []
            for prompt in PROMPTS[:2]:
                drafter = LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=512))
                runs.append(await EdgeSession(channel, drafter).run(request(prompt, 24)))
            stub = pb_grpc.VerifierStub(channel)
            info = await stub.GetModelInfo(pb.ModelInfoRequest())
            totals = await stub.GetStats(pb.StatsRequest())
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await reflect.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            services = {s.name for s in (await reflect.read()).list_services_response.service}
            reflect.cancel()
            refused = stub.Session()
            await refused.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=[])))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await refused.read()
        replica = next(iter(pool.info.values()))
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            direct = await stub.GetModelInfo(pb.ModelInfoRequest(), metadata=as_the_front(pool))
        return runs, info, direct, totals, await replica_stats(pool), health, services, error.value

    runs, info, direct, totals, per_replica, health, services, error = loop.run(scenario())
    for prompt, (ids, stats) in zip(PROMPTS, runs, strict=False):
        assert ids == expected(engine, prompt, 24)
        assert stats.resumes == 0
    assert info == direct and info.target_id == model_name(test_pair.target_dir) and info.max_gamma == 8
    assert totals.rounds == sum(s.rounds for s in per_replica.values()) >= sum(s.rounds for _, s in runs)
    assert totals.generated_tokens == sum(s.generated_tokens for s in per_replica.values())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {"draftwire.v1.Verifier", "grpc.health.v1.Health"} <= services
    # A replica's refusal reaches the edge unchanged.
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in error.details()


def test_sessions_go_to_the_least_loaded_replica_and_stay_there(pool, loop, engine):
    """Four concurrent sessions: two per replica, each served start to end by one replica."""

    async def scenario():
        before = await replica_stats(pool)
        async with grpc.aio.insecure_channel(pool.address) as channel:
            runs = [
                EdgeSession(channel, replay(engine, p, 48, delay_s=0.002, seed=i)).run(request(p, 48))
                for i, p in enumerate(PROMPTS)
            ]
            results = await asyncio.gather(*runs)
        after = await replica_stats(pool)
        return results, before, after

    results, before, after = loop.run(scenario())
    for prompt, (ids, stats) in zip(PROMPTS, results, strict=True):
        assert ids == expected(engine, prompt, 48) and stats.resumes == 0
    opened = sorted(after[n].sessions_opened - before[n].sessions_opened for n in after)
    assert opened == [2, 2]
    rounds = sum(after[n].rounds - before[n].rounds for n in after)
    assert rounds == sum(stats.rounds for _, stats in results)


def test_killed_replica_process_its_sessions_resume_elsewhere_exactly(pool, loop, engine):
    """SIGKILL of one replica's worker process in the middle of four generations: the two sessions it held
    break with UNAVAILABLE, the edges re-open with their committed tokens on the other replica, and every
    output equals the undisturbed one. Ray then restarts the killed replica at a new address."""
    new_tokens = 160
    victim = next(iter(pool.info))
    victim_pid = pool.info[victim].pid
    victim_address = pool.info[victim].address

    async def scenario():
        async with grpc.aio.insecure_channel(pool.address) as channel:
            runs = [generation(channel, engine, p, new_tokens, seed=i) for i, p in enumerate(PROMPTS)]
            committed = [c for _, c, _ in runs]
            while min(len(c) for c in committed) < 16:
                await asyncio.sleep(0.01)
            assert pool.table.slots[victim].sessions == 2
            at_kill = [len(c) for c in committed]
            os.kill(victim_pid, signal.SIGKILL)
            await asyncio.gather(*(task for task, _, _ in runs))
            return committed, [s for _, _, s in runs], at_kill

    committed, stats, at_kill = loop.run(scenario())
    assert all(n < new_tokens for n in at_kill), "the kill landed after a generation had finished"
    for prompt, ids in zip(PROMPTS, committed, strict=True):
        assert ids == expected(engine, prompt, new_tokens)
    assert sum(s.resumes for s in stats) == 2
    loop.run(pool.wait_for(live(2), timeout=120))
    assert pool.info[victim].pid != victim_pid and pool.info[victim].address != victim_address

    async def after_restart():
        async with grpc.aio.insecure_channel(pool.address) as channel:
            runs = [run_once(channel, engine, p, 24, seed=9) for p in PROMPTS[:2]]
            return await asyncio.gather(*runs), await replica_stats(pool)

    results, per_replica = loop.run(after_restart())
    assert [ids for ids, _ in results] == [expected(engine, p, 24) for p in PROMPTS[:2]]
    assert per_replica[victim].sessions_opened >= 1  # the restarted replica takes sessions again


def test_a_frozen_replica_is_routed_around_and_its_sessions_resume_elsewhere_exactly(pool, loop, engine):
    """SIGSTOP of one replica's process (frozen: its connections stay up, nothing answers) in the middle of
    four generations. Model info and new sessions through the front are answered by the other replica
    at once; the two sessions on the frozen one stall a few health checks, not the whole freeze, then
    resume elsewhere with their committed tokens, and every output equals the undisturbed one. Once the
    replica is continued it is trusted again."""
    new_tokens = 200
    loop.run(pool.wait_for(live(2), timeout=120))
    victim = next(iter(pool.info))
    victim_pid = pool.info[victim].pid

    async def scenario():
        async with grpc.aio.insecure_channel(pool.address) as channel:
            runs = [generation(channel, engine, p, new_tokens, seed=i) for i, p in enumerate(PROMPTS)]
            committed = [c for _, c, _ in runs]
            while min(len(c) for c in committed) < 16:
                await asyncio.sleep(0.01)
            on_victim = pool.table.slots[victim].sessions
            os.kill(victim_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            at_stop = [len(c) for c in committed]
            moved = [None] * len(runs)  # seconds after the stop each generation moved on

            async def watch():
                while None in moved:
                    for i, c in enumerate(committed):
                        if moved[i] is None and len(c) > at_stop[i]:
                            moved[i] = time.monotonic() - stopped
                    await asyncio.sleep(0.01)

            watcher = asyncio.get_running_loop().create_task(watch())
            try:
                await asyncio.sleep(0.2)  # frozen before the front's next health check
                stub = pb_grpc.VerifierStub(channel)
                infos, opens = [], []
                for _ in range(4):
                    start = time.monotonic()
                    await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=15)
                    infos.append(time.monotonic() - start)
                for p in PROMPTS[:2]:
                    start = time.monotonic()
                    call = await held(channel, p)
                    opens.append(time.monotonic() - start)
                    assert not isinstance(call, grpc.aio.AioRpcError), call.details()
                    call.cancel()
                await asyncio.gather(*(task for task, _, _ in runs))
                await asyncio.wait_for(watcher, 5)
            finally:
                watcher.cancel()
                os.kill(victim_pid, signal.SIGCONT)
            return committed, [s for _, _, s in runs], at_stop, on_victim, infos, opens, moved

    committed, stats, at_stop, on_victim, infos, opens, moved = loop.run(scenario(), timeout=180)
    print(f"\nfrozen replica: model info {max(infos):.2f} s, opens {max(opens):.2f} s, stalls", moved)
    assert on_victim == 2 and all(n < new_tokens for n in at_stop)
    for prompt, ids in zip(PROMPTS, committed, strict=True):
        assert ids == expected(engine, prompt, new_tokens)
    assert sum(s.resumes for s in stats) == 2
    # Bounds of the behaviour itself, generous for a busy machine: a relay's deadline is 2 s (it took the
    # full 10 s before), and a frozen session stalls about two 1 s health checks (before: the freeze).
    assert max(infos) < 5 and max(opens) < 5, (infos, opens)
    assert max(moved) < 12, moved
    loop.run(pool.wait_for(lambda p: not p.table.slots[victim].suspect, timeout=30))


def test_scaling_down_drains_a_replica_without_cutting_its_session(pool, loop, engine):
    """Resize 2 -> 1 while each replica holds a session: the drained one gets no new session, keeps its own
    to the end, and only then is its process killed."""
    new_tokens = 120

    async def scenario():
        async with grpc.aio.insecure_channel(pool.address) as channel:
            runs = [generation(channel, engine, p, new_tokens, seed=i) for i, p in enumerate(PROMPTS[:2])]
            while min(len(committed) for _, committed, _ in runs) < 4:
                await asyncio.sleep(0.01)
            assert sorted(s.sessions for s in pool.table.slots.values()) == [1, 1]
            pool.resize(1)
            [drained] = pool.table.of(State.DRAINING)
            pid = pool.info[drained.name].pid
            extra = await run_once(channel, engine, PROMPTS[2], 16)
            assert drained.sessions == 1 and os.path.exists(f"/proc/{pid}")
            await asyncio.gather(*(task for task, _, _ in runs))
            await pool.wait_for(lambda p: drained.name not in p.table.slots, 30)
            return [(committed, stats) for _, committed, stats in runs], extra, pid

    results, extra, pid = loop.run(scenario())
    for prompt, (ids, stats) in zip(PROMPTS, results, strict=False):
        assert ids == expected(engine, prompt, new_tokens) and stats.resumes == 0
    assert extra[0] == expected(engine, PROMPTS[2], 16)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}")

    async def back_to_two():
        pool.resize(2)
        await pool.wait_for(live(2), timeout=120)

    loop.run(back_to_two(), timeout=150)


def test_a_drain_past_its_timeout_ends_the_session_and_its_edge_resumes_elsewhere(loop, test_pair, engine):
    """Resize 2 -> 1 with a drain timeout of 0.5 s: the drained replica's session ends with UNAVAILABLE
    (the replica drains gracefully, then goes), its edge resumes on the other replica through the front
    with every committed token, and both outputs are exactly the target's."""
    scaling = ScalingConfig(min_replicas=2, max_replicas=2, interval_s=0.5, drain_timeout_s=0.5)
    pool, front, address = loop.run(start_pool(pool_config(test_pair, scaling)), timeout=180)
    new_tokens = 120
    try:

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                runs = [generation(channel, engine, p, new_tokens, seed=i) for i, p in enumerate(PROMPTS[:2])]
                while min(len(committed) for _, committed, _ in runs) < 4:
                    await asyncio.sleep(0.01)
                pool.resize(1)
                [drained] = pool.table.of(State.DRAINING)
                await asyncio.gather(*(task for task, _, _ in runs))
                await pool.wait_for(lambda p: drained.name not in p.table.slots, 30)
                return [(committed, stats) for _, committed, stats in runs]

        results = loop.run(scenario(), timeout=180)
    finally:
        loop.run(front.stop(0))
        loop.run(pool.close())
    for prompt, (ids, _) in zip(PROMPTS, results, strict=False):
        assert ids == expected(engine, prompt, new_tokens)
    assert sorted(stats.resumes for _, stats in results) == [0, 1]


def test_a_session_a_replica_refuses_is_opened_on_the_other_and_refused_when_both_do(loop, test_pair, engine):
    """Replicas that hold two sessions at most (--max-sessions 2). One session is held through the front,
    which counts it on replica P; two are held on the other replica, Q, past the front, so Q is full while
    the front counts it idle. A generation's open goes to Q first (the least loaded as the front counts),
    Q refuses it with RESOURCE_EXHAUSTED, and the front opens it on P: the target's exact tokens, no
    resume. With P full as well, an open both refuse reaches the edge as RESOURCE_EXHAUSTED with the
    replicas' retry-after-ms."""
    scaling = ScalingConfig(min_replicas=2, max_replicas=2, interval_s=0.5)
    admission = AdmissionConfig(max_sessions=2, max_sessions_per_client=0, retry_after_s=0.25)
    config = pool_config(test_pair, scaling, admission)
    pool, front, address = loop.run(start_pool(config), timeout=180)
    calls = []
    try:

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                calls.append(await held(channel, PROMPTS[1]))
                [p] = [s for s in pool.table.slots.values() if s.sessions == 1]
                [q] = [s for s in pool.table.slots.values() if s.sessions == 0]
                async with grpc.aio.insecure_channel(q.address) as direct:
                    for prompt in PROMPTS[2:4]:
                        calls.append(await held(direct, prompt, as_the_front(pool)))
                    before = await replica_stats(pool)
                    ids, stats = await run_once(channel, engine, PROMPTS[0], 24)
                    while (await replica_stats(pool))[p.name].active_sessions != 1:
                        await asyncio.sleep(0.05)  # the generation's session has ended on P
                    after = await replica_stats(pool)
                    calls.append(await held(channel, PROMPTS[1]))  # refused by Q, P takes it: P is full
                    refused = await held(channel, PROMPTS[0])
                    return p.name, q.name, before, after, ids, stats, refused, await replica_stats(pool)

        p, q, before, after, ids, stats, refused, last = loop.run(scenario(), timeout=180)
    finally:
        for call in calls:
            if not isinstance(call, grpc.aio.AioRpcError):
                call.cancel()
        loop.run(front.stop(0))
        loop.run(pool.close())
    assert not any(isinstance(call, grpc.aio.AioRpcError) for call in calls)
    assert ids == expected(engine, PROMPTS[0], 24) and stats.resumes == 0
    assert after[q].refusals["RESOURCE_EXHAUSTED"] - before[q].refusals["RESOURCE_EXHAUSTED"] == 1
    assert after[q].sessions_opened == before[q].sessions_opened  # refused before any work
    assert after[p].sessions_opened - before[p].sessions_opened == 1
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "maximum of 2 sessions" in refused.details()
    assert dict(refused.trailing_metadata())["retry-after-ms"] == "250"
    # Q refused three opens, P one: the last open was tried on both.
    assert last[q].refusals["RESOURCE_EXHAUSTED"] - before[q].refusals["RESOURCE_EXHAUSTED"] == 3
    assert last[p].refusals["RESOURCE_EXHAUSTED"] - before[p].refusals["RESOURCE_EXHAUSTED"] == 1


def test_autoscaling_follows_open_sessions_and_drains_back(loop, test_pair, engine):
    """min 1, max 2, one session per replica: two open sessions bring a second replica up; when they end
    the pool drains back to one."""
    scaling = ScalingConfig(
        min_replicas=1, max_replicas=2, target_sessions_per_replica=1, interval_s=0.2, downscale_delay_s=1.0
    )
    pool, front, address = loop.run(start_pool(pool_config(test_pair, scaling)), timeout=180)
    try:

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.VerifierStub(channel)
                silent = [stub.Session() for _ in range(4)]  # streams that never send a message
                await asyncio.sleep(1.5)  # several autoscaler intervals: they hold no slot, scale nothing
                assert len(pool.table.slots) == 1 and pool.open_sessions == 0
                for call in silent:
                    call.cancel()
                held = []
                for prompt in PROMPTS[:2]:  # sessions opened and left waiting: load without work
                    call = stub.Session()
                    await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt)))
                    await call.read()
                    held.append(call)
                await pool.wait_for(live(2), timeout=120)
                ids, _ = await run_once(channel, engine, PROMPTS[3], 16)
                for call in held:
                    call.cancel()
                # A cancelled edge stream cancels the replica's stream, which frees the session's cache.
                while (await stub.GetStats(pb.StatsRequest())).active_sessions:
                    await asyncio.sleep(0.05)
                await pool.wait_for(live(1), timeout=30)
                return ids

        assert loop.run(scenario(), timeout=180) == expected(engine, PROMPTS[3], 16)
    finally:
        loop.run(front.stop(0))
        loop.run(pool.close())


def test_replicas_are_placed_one_per_gpu_of_the_cluster(loop, test_pair):
    """On a cluster with GPUs, the defaults (`serve --ray` without --replicas or --gpus-per-replica)
    give each replica one GPU, and the pool as many replicas as the cluster has GPUs, read from the
    running cluster."""
    pool = Pool(pool_config(test_pair, ScalingConfig(min_replicas=None, max_replicas=None), gpus=None))
    assert (pool.config.replica.num_gpus, pool.config.scaling.min_replicas) == (1.0, GPUS)
    assert pool.config.scaling.max_replicas == GPUS


def test_a_pool_of_mixed_numerics_on_gpus_resumes_a_session_only_on_its_own(loop, test_pair, engine):
    """Two replicas on GPUs of their own, started with different numerics: one with the bit-exact
    kernels, one with plain ones (--no-bit-exact), as replicas on two GPU models differ. A session on
    the exact replica whose process is killed waits for that replica's restart and resumes there
    exactly, never on the live plain one. When the exact replica is gone for good, the resume is refused
    with FAILED_PRECONDITION naming the numerics, and the edge keeps every token committed so far, each
    the target's."""
    scaling = ScalingConfig(min_replicas=1, max_replicas=1, interval_s=0.5)
    pool, front, address = loop.run(start_pool(pool_config(test_pair, scaling, gpus=None)), timeout=180)
    new_tokens = 160
    try:
        pool._replica_config = replace(pool._replica_config, invariant=False)  # noqa: SLF001 - the next replica
        loop.run(_resized(pool, 2), timeout=150)
        by_kind = {pool.info[n].numerics.rsplit("/", 1)[1]: n for n in pool.info}
        assert sorted(by_kind) == ["exact", "plain"], pool.info
        exact, plain = by_kind["exact"], by_kind["plain"]
        assert pool.info[exact].numerics == engine.numerics.identity
        # Placed: a GPU each, not the same one.
        assert sorted(pool.info[n].gpus for n in (exact, plain)) == [(0,), (1,)], pool.info

        async def killed_mid_run(kill):
            """Two paced generations, one on each replica; `kill` when both have committed 16 tokens.
            Returns (prompt, committed ids, stats, exception or None) per generation, and the replicas'
            stats just before the kill."""
            await pool.wait_for(live(2), timeout=120)
            async with grpc.aio.insecure_channel(address) as channel:
                runs = [generation(channel, engine, p, new_tokens, seed=i) for i, p in enumerate(PROMPTS[:2])]
                while min(len(c) for _, c, _ in runs) < 16:
                    await asyncio.sleep(0.01)
                assert [s.sessions for s in pool.table.slots.values()] == [1, 1]
                before = await replica_stats(pool)
                kill()
                outcomes = await asyncio.gather(*(task for task, _, _ in runs), return_exceptions=True)
            runs = [(p, c, s, o) for p, (_, c, s), o in zip(PROMPTS, runs, outcomes, strict=False)]
            return runs, before

        # 1. SIGKILL: Ray restarts the exact replica, and its session waits for it.
        runs, before = loop.run(killed_mid_run(lambda: os.kill(pool.info[exact].pid, signal.SIGKILL)), 180)
        [(prompt, ids, _, outcome)] = [r for r in runs if r[2].resumes == 1]
        assert outcome is None and ids == expected(engine, prompt, new_tokens)
        after = loop.run(replica_stats(pool))
        assert after[plain].sessions_opened == before[plain].sessions_opened  # no resume went there
        assert after[exact].sessions_opened >= 1  # the restarted process took the resume

        # 2. Gone for good (no restart): nothing computes the session's numerics any more. The pool
        # replaces the replica with one of the plain kind, and the resume is refused, not moved there.
        actor = pool._actors[exact]  # noqa: SLF001
        runs, _ = loop.run(killed_mid_run(lambda: ray.kill(actor, no_restart=True)), 180)
        [(prompt, ids, _, outcome)] = [r for r in runs if r[3] is not None]
        assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION, outcome
        assert engine.numerics.identity in outcome.details
        assert 16 <= len(ids) < new_tokens and ids == expected(engine, prompt, new_tokens)[: len(ids)]
    finally:
        loop.run(front.stop(0))
        loop.run(pool.close())


async def _resized(pool: Pool, n: int) -> None:
    pool.resize(n)
    await pool.wait_for(live(n), timeout=120)
