"""The replicas' control plane on Ray: launch, follow restarts, scale, drain. No Ray call per round.

Ray places each replica (an actor holding `num_cpus`/`num_gpus`), restarts its process when it dies
(`max_restarts`) and tells the pool: one `until_stopped` call per replica stays pending, and Ray fails
it the moment the process is gone. The pool then routes around the replica and asks the next
incarnation to `start` (a call that Ray holds until the restart is done), which re-loads the target
and answers with a new address. Sessions reach replicas over gRPC channels kept here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import ssl
import tempfile
from collections.abc import Collection

import grpc
import ray
from ray.exceptions import RayActorError

from cluster.config import PoolConfig, ReplicaConfig, placed
from cluster.replica import ReplicaInfo, VerifierReplica
from cluster.routing import Autoscaler, RoutingTable, Slot, State
from draftwire import wire
from draftwire.aio import within
from verifier_service.auth import ADMIN_HEADER, CLIENT_HEADER, AuthConfig, Identity, TlsConfig

log = logging.getLogger(__name__)


class NoReplica(Exception):
    """No live replica within the open timeout (gRPC UNAVAILABLE)."""


class NoSuchNumerics(Exception):
    """A resumed session asks for numerics no replica of the pool computes (gRPC FAILED_PRECONDITION):
    continuing elsewhere could give other tokens, so the session ends with what it committed."""


class Pool:
    def __init__(self, config: PoolConfig):
        """`config`'s GPUs and replica counts left to the cluster are placed on the running Ray
        cluster's GPUs (cluster.config.placed; as on a cluster without GPUs where Ray is not running,
        which launches nothing)."""
        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        config = self.config = placed(config, gpus)
        self.table = RoutingTable()
        self.autoscaler = Autoscaler(config.scaling)
        self.info: dict[str, ReplicaInfo] = {}  # each replica's current incarnation
        self._actors: dict[str, ray.actor.ActorHandle] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._names = itertools.count(1)
        self._waiting = 0  # sessions waiting for a live replica
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._replica_class = ray.remote(VerifierReplica)
        # Replicas take calls from this front only: each holds the pool's secret (handed over through
        # Ray) and, when the front serves TLS, serves TLS with the front's certificate, which the front
        # pins. The secret is made here, so no pool can start without one.
        self._secret = secrets.token_urlsafe(32)
        self._replica_config = secured(config.replica, config.front.tls, self._secret)
        self._hop = hop_credentials(config.front.tls)

    # --- data plane helpers (per session, never per round) ---

    async def acquire(self, session: bool = True, exclude: Collection[str] = (), numerics: str = "") -> Slot:
        """The least loaded live replica, with the session counted on it until `release`; waits while
        none is live. `session=False` only picks (a unary call, which is not load). `exclude` names the
        replicas that refused this session already: the next one is live now or not at all, no wait.
        `numerics`: a resumed session's numerics identity; only a replica of that identity serves it.

        Raises NoReplica after open_timeout_s, or at once when no live replica is left outside `exclude`;
        NoSuchNumerics at once when no replica of the pool (live, restarting or starting) has `numerics`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.open_timeout_s
        self._waiting += session
        try:
            while (
                slot := self.table.acquire(exclude, numerics)
                if session
                else self.table.pick(exclude, numerics)
            ) is None:
                if numerics and not any(
                    self.info.get(name) is None or self.info[name].numerics == numerics
                    for name in self.table.slots
                ):
                    raise NoSuchNumerics(
                        f"no verifier replica computes numerics {numerics}, which this session began "
                        "with: it cannot continue elsewhere without risking other tokens"
                    )
                if exclude:
                    raise NoReplica("no other live verifier replica to try")
                if not await self._wait_change(deadline - loop.time()):
                    raise NoReplica(f"no live verifier replica within {self.config.open_timeout_s:g} s")
            return slot
        finally:
            self._waiting -= session

    def release(self, slot: Slot) -> None:
        self.table.release(slot)
        self._notify()  # a draining replica may now be empty

    def channel(self, slot: Slot) -> grpc.aio.Channel:
        return self._channels[slot.name]

    def hop_metadata(self, client: Identity) -> tuple[tuple[str, str], ...]:
        """What a call to a replica carries: the pool's secret, and the client the front speaks for."""
        return (
            ("authorization", f"Bearer {self._secret}"),
            (CLIENT_HEADER, client.name),
            (ADMIN_HEADER, "1" if client.admin else "0"),
        )

    def replica_failed(self, slot: Slot) -> None:
        """A stream to the replica broke with UNAVAILABLE: no new session goes there until the pool has
        confirmed through Ray that it serves (the same process, or a restarted one)."""
        if slot.state is State.LIVE:
            log.warning("replica %s at %s unreachable; routing around it", slot.name, slot.address)
            self.table.down(slot.name)
            self._notify()
            self._spawn(self._confirm(slot.name))

    def suspect(self, slot: Slot, why: str) -> None:
        """The replica missed a health check or a deadline (`why`): no new session goes there until it
        answers again (`trusted`)."""
        if not slot.suspect:
            log.warning("replica %s at %s %s: routing new sessions around it", slot.name, slot.address, why)
            slot.suspect = True
            self._notify()

    def trusted(self, slot: Slot) -> None:
        """A suspect replica answered its health check: it takes new sessions again."""
        if slot.suspect:
            log.info("replica %s at %s answers again", slot.name, slot.address)
            slot.suspect = False
            self._notify()

    def has_channel(self, slot: Slot) -> bool:
        return slot.name in self._channels

    @property
    def open_sessions(self) -> int:
        """Sessions streaming through a replica plus those waiting for one: the load scaling follows."""
        return self.table.sessions + self._waiting

    # --- control plane ---

    async def start(self) -> None:
        """Launches min_replicas and returns once they all serve; then keeps the count right.

        Raises what a replica's first start raised (a bad model directory, say).
        """
        names = [self._launch() for _ in range(self.config.scaling.min_replicas)]
        await asyncio.gather(*(self._first_start(n) for n in names))
        self._spawn(self._autoscale())

    def resize(self, min_replicas: int, max_replicas: int | None = None) -> None:
        """New bounds (max defaults to min: a fixed pool), applied now rather than at the next look.

        Raises ValueError for impossible bounds.
        """
        scaling = dataclasses.replace(
            self.autoscaler.scaling, min_replicas=min_replicas, max_replicas=max_replicas or min_replicas
        )
        self.autoscaler = Autoscaler(scaling)
        current = len(self.table.of(State.STARTING, State.LIVE, State.DOWN))
        self.scale_to(max(scaling.min_replicas, min(scaling.max_replicas, current)))

    def scale_to(self, n: int) -> None:
        """Launches replicas (or takes back draining ones) up to n, or drains the surplus."""
        active = self.table.of(State.STARTING, State.LIVE, State.DOWN)
        for _ in range(n - len(active)):
            draining = [s for s in self.table.of(State.DRAINING) if s.address]
            if draining:
                slot = max(draining, key=lambda s: s.sessions)
                self.table.live(slot.name, slot.address)
                log.info("replica %s taken back from draining", slot.name)
            else:
                self._spawn(self._first_start(self._launch()))
        # Drain the replicas whose going costs least: not yet serving, then the least loaded.
        surplus = sorted(reversed(active), key=lambda s: (s.state is State.LIVE, s.sessions))
        for slot in surplus[: max(0, len(active) - n)]:
            self.table.drain(slot.name)
            log.info("draining replica %s (%d sessions)", slot.name, slot.sessions)
            self._spawn(self._drain(slot.name))
        self._notify()

    async def wait_for(self, predicate, timeout: float | None) -> None:
        """Waits until predicate(pool) holds; raises TimeoutError after timeout seconds (None: never)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not predicate(self):
            if not await self._wait_change(None if deadline is None else deadline - loop.time()):
                raise TimeoutError("pool did not reach the expected state")

    async def close(self) -> None:
        """Kills every replica and stops the control plane."""
        for task in list(self._tasks):
            task.cancel()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
        for name in list(self._actors):
            self._retire(name)

    def _launch(self) -> str:
        name = f"replica-{next(self._names)}"
        r = self._replica_config
        self._actors[name] = self._replica_class.options(
            num_cpus=r.num_cpus, num_gpus=r.num_gpus, max_restarts=r.max_restarts, max_concurrency=16
        ).remote(r)
        self.table.add(name)
        return name

    async def _first_start(self, name: str) -> None:
        try:
            if await self._confirm(name):
                self._spawn(self._watch(name))
        except Exception:
            log.exception("replica %s failed to start", name)
            self._retire(name)
            raise

    async def _watch(self, name: str) -> None:
        """Follows one replica for its life: DOWN when its process dies, LIVE again after Ray's restart."""
        actor = self._actors[name]
        while name in self.table.slots:
            try:
                await actor.until_stopped.remote()
                return  # stopped on purpose
            except RayActorError:
                pass
            if name not in self.table.slots:
                return
            log.warning("replica %s process died; waiting for Ray to restart it", name)
            self.table.down(name)
            self._notify()
            try:
                if not await self._confirm(name):
                    return
            except Exception:  # the new incarnation could not start (the model went away, say)
                log.exception("replica %s failed to restart; dropping it", name)
                self._retire(name)
                return

    async def _confirm(self, name: str) -> bool:
        """Asks the replica's current incarnation to serve (Ray holds the call through a restart);
        False when the replica is gone for good, which the autoscaler then replaces."""
        try:
            info = await self._actors[name].start.options(max_task_retries=-1).remote()
        except RayActorError:
            if name in self.table.slots:
                log.error("replica %s is gone for good (out of restarts)", name)
                self._retire(name)
            return False
        if name in self.table.slots:
            self._serving(name, info)
        return True

    def _serving(self, name: str, info: ReplicaInfo) -> None:
        slot = self.table.slots.get(name)
        if slot is None:
            return
        if slot.address != info.address:
            old = self._channels.pop(name, None)
            if old is not None:
                self._spawn(old.close())
            self._channels[name] = wire.channel(info.address, self._hop, self.config.front.message_limit)
        self.info[name] = info
        slot.numerics = info.numerics
        if slot.state is State.DRAINING:
            slot.address = info.address
        elif slot.state is not State.LIVE or slot.address != info.address:
            self.table.live(name, info.address)
            on = f", GPU {','.join(map(str, info.gpus))}" if info.gpus else ""
            log.info("replica %s serving at %s (pid %d%s)", name, info.address, info.pid, on)
        self._notify()

    async def _drain(self, name: str) -> None:
        timeout = self.config.scaling.drain_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while (slot := self.table.slots.get(name)) is not None and slot.state is State.DRAINING:
            if slot.sessions == 0:
                break
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if not await self._wait_change(left):
                log.warning("replica %s: drain timeout with %d sessions left", name, slot.sessions)
                break
        slot = self.table.slots.get(name)
        if slot is not None and slot.state is State.DRAINING:
            # The sessions left end with UNAVAILABLE (their edges resume through the front elsewhere)
            # before the process goes; a replica that does not answer is killed all the same.
            actor = self._actors.get(name)
            if actor is not None:
                try:
                    await within(actor.drain.remote(0.0), CUT_TIMEOUT_S)
                except Exception as e:  # gone already, or hung: the kill below ends it
                    log.warning("replica %s: no graceful drain (%s)", name, e)
            self._retire(name)
            log.info("replica %s drained and stopped", name)

    def _retire(self, name: str) -> None:
        self.table.remove(name)
        self.info.pop(name, None)
        channel = self._channels.pop(name, None)
        if channel is not None:
            self._spawn(channel.close())
        actor = self._actors.pop(name, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        self._notify()

    async def _autoscale(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.autoscaler.scaling.interval_s)
            current = len(self.table.of(State.STARTING, State.LIVE, State.DOWN))
            wanted = self.autoscaler.decide(self.open_sessions, current, loop.time())
            if wanted != current:
                log.info("scaling %d -> %d replicas (%d open sessions)", current, wanted, self.open_sessions)
                try:
                    self.scale_to(wanted)
                except Exception:  # keep looking: the next interval tries again
                    log.exception("scaling to %d replicas failed", wanted)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float | None) -> bool:
        """False when nothing changed within timeout."""
        if timeout is not None and timeout <= 0:
            return False
        try:
            await within(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pool task failed", exc_info=task.exception())


CUT_TIMEOUT_S = 5.0  # a draining replica's last sessions get this long to hear UNAVAILABLE


def secured(replica: ReplicaConfig, tls: TlsConfig | None, secret: str) -> ReplicaConfig:
    """The replicas' config: only callers holding `secret` are admitted; TLS with the front's certificate
    and key when the front has them (no client certificate asked: the secret names the front)."""
    server = dataclasses.replace(
        replica.server,
        tls=dataclasses.replace(tls, client_ca=None) if tls else None,
        auth=AuthConfig(front_secret=secret),
    )
    return dataclasses.replace(replica, server=server)


def hop_credentials(tls: TlsConfig | None) -> wire.ClientCredentials:
    """The front's side of the hop: plaintext, or TLS trusting exactly the front's own certificate, under
    the name it carries (a replica's address is its node's, which the certificate need not name)."""
    if tls is None:
        return wire.PLAINTEXT
    return wire.ClientCredentials(tls=True, ca=tls.cert_chain, server_name=certificate_name(tls.cert_chain))


def certificate_name(pem: bytes) -> str:
    """The first DNS name (else the subject CN) of the first certificate in a PEM chain.

    Raises ValueError when it names none."""
    first = pem[: pem.index(b"-----END CERTIFICATE-----") + len(b"-----END CERTIFICATE-----")]
    with tempfile.NamedTemporaryFile(suffix=".pem") as f:
        f.write(first)
        f.flush()
        decoded = ssl._ssl._test_decode_cert(f.name)  # the stdlib's decoder; ssl has no public one
    names = [v for k, v in decoded.get("subjectAltName", ()) if k == "DNS"]
    names += [v for rdn in decoded.get("subject", ()) for k, v in rdn if k == "commonName"]
    if not names:
        raise ValueError("the server certificate names no host (no DNS subjectAltName, no CN)")
    return names[0]
