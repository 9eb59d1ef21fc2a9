"""A session never continues on other numerics: a verifier refuses a resume that asks for another identity,
and a pool's front routes a resumed session only to replicas of its identity, ending it (committed tokens
kept by the edge) where none is left. Replicas of different dtypes are stood in by their ReplicaInfo: the
routing is the pool's, whatever started the replicas."""

import asyncio

import pytest

from cluster.config import PoolConfig, ReplicaConfig
from cluster.pool import NoReplica, NoSuchNumerics, Pool
from cluster.replica import ReplicaInfo
from draftwire.contract import Numerics, SessionSpec
from tools.testkit.fakes import FakeEngine
from verifier_service.batcher import Batcher
from verifier_service.session import VerifierLimits, VerifierSession, WrongState

F32 = Numerics("float32", "onednn-avx2", "cpu", True).identity
BF16 = Numerics("bfloat16", "onednn-avx512_core_amx", "cpu", True).identity


def open_session(spec: SessionSpec, engine: FakeEngine):
    async def run():
        batcher = Batcher(engine)
        try:
            return await VerifierSession.open(batcher, spec, VerifierLimits(max_gamma=8))
        finally:
            batcher.close()

    return asyncio.run(run())


def test_a_resume_asking_for_other_numerics_is_refused_and_the_same_is_served():
    engine = FakeEngine()
    own = engine.numerics.identity
    with pytest.raises(WrongState, match=f"numerics {BF16}.*computes {own}"):
        open_session(SessionSpec((5, 9), generated_token_ids=(3,), numerics=BF16), engine)
    session = open_session(SessionSpec((5, 9), generated_token_ids=(3,), numerics=own), engine)
    assert session.committed == [5, 9, 3]
    assert open_session(SessionSpec((5, 9)), engine).committed == [5, 9]  # a first open: any


def pool_of(replicas: dict[str, str]) -> Pool:
    """A pool (no Ray started) whose replicas named in `replicas` serve with those numerics."""
    pool = Pool(PoolConfig(ReplicaConfig(target_dir="unused"), open_timeout_s=0.2))
    for name, identity in replicas.items():
        pool.table.add(name)
        pool._channels[name] = None  # noqa: SLF001 - no channel is opened by _serving's test double
        pool.info[name] = ReplicaInfo(f"127.0.0.1:{len(pool.info) + 1}", 1, "t", identity)
        pool.table.live(name, pool.info[name].address)
        pool.table.slots[name].numerics = identity
    return pool


def test_the_pool_routes_a_resume_to_its_numerics_only():
    async def run():
        pool = pool_of({"r1": F32, "r2": BF16, "r3": F32})
        picks = [(await pool.acquire(numerics=BF16)).name for _ in range(3)]
        assert picks == ["r2", "r2", "r2"]
        f32 = {(await pool.acquire(numerics=F32)).name for _ in range(4)}
        assert f32 == {"r1", "r3"}
        first = {(await pool.acquire()).name for _ in range(6)}  # a new session: any replica
        assert first == {"r1", "r2", "r3"}

    asyncio.run(run())


def test_a_resume_whose_numerics_no_replica_has_ends_at_once():
    async def run():
        pool = pool_of({"r1": F32})
        with pytest.raises(NoSuchNumerics, match=BF16):
            await pool.acquire(numerics=BF16)
        # Its replica down (restarting): the session waits for it rather than moving elsewhere.
        pool = pool_of({"r1": BF16, "r2": F32})
        pool.table.down("r1")
        with pytest.raises(NoReplica):
            await pool.acquire(numerics=BF16)
        assert (await pool.acquire(numerics=F32)).name == "r2"

    asyncio.run(run())
