"""Batched verification across sessions: forwards that queue up while the engine is busy run together.

One worker feeds the engine on one thread. While a batch runs, the forwards of other sessions queue;
the next batch takes them all (up to max_batch), so batches grow with load and a lone session pays
no waiting. An optional window holds the first forward a little longer to gather more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from draftwire.aio import within
from draftwire.contract import BATCH_SECONDS_BUCKETS, BATCH_SIZE_BUCKETS, Numerics, TargetInfo, bucket
from draftwire.speculation import CostLine
from verifier_service import numerics as numerics_
from verifier_service.engine import Forward
from verifier_service.gamma_cap import GammaCap
from verifier_service.settings import BatchConfig, PrefixCacheConfig


class Engine(Protocol):
    """What the batcher runs: `TargetEngine`, or a fake with deterministic logits in tests."""

    info: TargetInfo
    numerics: Numerics  # what decides the logits' bits (verifier_service/numerics.py)

    def forward_many(self, forwards: Sequence[Forward]) -> list[torch.Tensor | None]: ...

    def release(self, key: str) -> None: ...

    def adopt(
        self, key: str, token_ids: Sequence[int], owner: str = "", max_positions: int | None = None
    ) -> int: ...


class ServedEngine(Engine, Protocol):
    """What a server reads of its engine besides what the batcher runs: the figures of GetStats and the
    metrics, the KV bytes admission reserves, and the kept caches' setting. `TargetEngine` and the
    fake of the in-process tests (tools/testkit/fakes.py) both implement it."""

    active_sessions: int  # sessions holding a KV cache
    cache_bytes: int  # the KV memory held: live sessions' caches and kept ones
    bytes_per_position: int  # KV memory of one cached position (0: the engine reserves nothing)
    device: object  # where the KV caches live (a torch.device or its name): admission's budget reads it
    prefix_cache: Sized  # the kept caches (their number is a figure)

    def keep_finished(self, config: PrefixCacheConfig, room: Callable[[], int] | None = None) -> None: ...


ACTIVE_S = 1.0  # a session that sent a round this recently is playing rounds (Batcher.prefill_room)


CALIBRATION_KEY = "#calibrate"  # the session Batcher.calibrate times its forwards on ('#': no client's)


@dataclass
class BatchStats:
    batches: int = 0  # engine calls
    forwards: int = 0  # session forwards inside them
    seconds: float = 0.0  # wall time of the engine calls
    # Engine calls per bucket of duration and of size (draftwire.contract's bounds, one open bucket).
    seconds_counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SECONDS_BUCKETS) + 1))
    size_counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SIZE_BUCKETS) + 1))
    last: dict[str, tuple[float, int]] = field(default_factory=dict)  # key -> its last batch's (s, size)
    # A round's forward time by its positions, as its edge measures it (Verdict.verify_seconds), smoothed
    # over every session's rounds: what SessionOpened.forward_seconds tells new edges.
    round_costs: CostLine = field(default_factory=lambda: CostLine(smoothing=0.1, fixed_share=0.5))

    def record(self, keys: list[str], seconds: float) -> None:
        self.batches += 1
        self.forwards += len(keys)
        self.seconds += seconds
        self.seconds_counts[bucket(BATCH_SECONDS_BUCKETS, seconds)] += 1
        self.size_counts[bucket(BATCH_SIZE_BUCKETS, len(keys))] += 1
        for key in keys:
            self.last[key] = (seconds, len(keys))


class Batcher:
    def __init__(
        self, engine: Engine, config: BatchConfig = BatchConfig(), gamma_cap: GammaCap | None = None
    ):
        """`gamma_cap`: told of every batch, for the γ cap the verdicts advertise (None: no cap)."""
        self.engine = engine
        self.config = config
        self.gamma_cap = gamma_cap
        self.stats = BatchStats()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        self._pending: list[tuple[Forward, asyncio.Future]] = []
        self._releases: list[str] = []
        self._open: set[str] = set()  # sessions that may send a forward
        self._last_batch_s = 0.0
        self._last_end: float | None = None  # when the last batch ended (perf_counter)
        self._round_s: float | None = None  # a batch's rounds' time, smoothed (None: none measured yet)
        self._rounds_at: dict[str, float] = {}  # session -> when it last sent a round (event loop time)
        self._chunk = 1.0  # timed prefill positions a batch, on average (prefill_room)
        self._credit = 0.0  # a chunk under 1: its parts gathered over batches that carried no prefill
        self._idle_chunk = float(config.max_prefill_positions)  # the same while no session plays rounds
        self._position_s: float | None = None  # a prefill position's cost beside rounds (_resize)
        self._idle_position_s: float | None = None  # the same in batches of prefill alone
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    @property
    def info(self) -> TargetInfo:
        return self.engine.info

    async def forward(self, forward: Forward) -> torch.Tensor | None:
        """The forward's logits, computed in some batch; raises what the engine raised."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if forward.wants_logits:
            self._rounds_at[forward.key] = loop.time()
        self._pending.append((forward, future))
        self._kick()
        return await future

    def join(self, key: str) -> None:
        """Counts a session as open: batches wait a little for its forwards."""
        self._open.add(key)

    def release(self, key: str) -> None:
        """Frees a session's cache after every forward of it already queued."""
        self._open.discard(key)
        self._rounds_at.pop(key, None)
        self._releases.append(key)
        self._kick()

    async def adopt(
        self, key: str, token_ids: Sequence[int], owner: str = "", max_positions: int | None = None
    ) -> int:
        """Starts session `key` of client `owner`, with at most `max_positions` positions of cache, from
        a kept cache of that client's that shares a prefix with `token_ids` (engine.adopt); returns the
        positions it starts with. Releases queued before it are carried out first, so a conversation's
        next turn finds the cache its last turn released."""
        pending = {f.key for f, _ in self._pending}
        early = [k for k in self._releases if k not in pending]
        self._releases = [k for k in self._releases if k in pending]
        return await self.call(self._adopt, key, token_ids, early, owner, max_positions)

    def _adopt(self, key, token_ids, releases: list[str], owner: str, max_positions: int | None) -> int:
        for k in releases:
            self.engine.release(k)
            self.stats.last.pop(k, None)
        return self.engine.adopt(key, token_ids, owner, max_positions)

    async def call(self, fn, *args):
        """Runs fn on the engine's thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stops the worker and the engine's thread; releases still queued are carried out first."""
        if self._worker is not None:
            self._worker.cancel()
        releases, self._releases = self._releases, []
        self._executor.submit(self._run_batch, [], releases)
        self._executor.shutdown(wait=True)

    def _kick(self) -> None:
        if self._worker is None:
            self._wake = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending or self._releases:
                await self._gather()
                batch, self._pending = self._take_batch(self._pending)
                releases, self._releases = self._releases, []
                if not batch and not releases:  # prefill held back to ride with the next round
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await within(self._wake.wait(), ACTIVE_S)
                    continue
                try:
                    results = await self.call(self._run_batch, [f for f, _, _ in batch], releases)
                except Exception as e:  # the engine failed: every session in the batch hears it
                    for _, future, _ in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                self._observe_load([f for f, _, _ in batch])
                for (_, future, whole), result in zip(batch, results, strict=True):
                    if whole and not future.done():
                        future.set_result(result)

    def _observe_load(self, forwards: list[Forward]) -> None:
        """Tells the γ cap of the batch that just ended: its rounds, positions, time, the time since the
        last batch ended (so the engine's busy share), and the sessions open."""
        now = time.perf_counter()
        if self.gamma_cap is not None and forwards:
            interval = now - self._last_end if self._last_end is not None else None
            rounds = sum(f.wants_logits for f in forwards)
            positions = sum(len(f.token_ids) for f in forwards)
            self.gamma_cap.observe_batch(rounds, positions, self._last_batch_s, interval, len(self._open))
        self._last_end = now

    def _take_batch(self, pending: list) -> tuple[list, list]:
        """The next batch from `pending`, and what stays pending.

        At most max_batch forwards, one per session (its oldest: a session's forwards run in the order
        they came). Rounds go first, in arrival order, and are never cut; then prefills, the fewest
        positions left first (a new session's short prompt does not wait for the chunks of a long one),
        within the room (`prefill_room`). A prefill longer than the room left contributes its first
        positions (its future still pending, `whole` False), and its rest stays queued."""
        batch, left = [], []  # batch: (forward, future, whole)
        heads, later = {}, []  # each session's oldest forward; the others, in arrival order
        for item in pending:
            if item[1].done():
                continue
            if item[0].key in heads:
                later.append(item)
            else:
                heads[item[0].key] = item
        room, timed = self.prefill_room()
        for forward, future in sorted(heads.values(), key=lambda item: _prefill_last(item[0])):
            if len(batch) >= self.config.max_batch:
                left.append((forward, future))
                continue
            positions = len(forward.token_ids)
            if room is not None and _prefill_last(forward)[0]:
                if room == 0:
                    left.append((forward, future))
                    continue
                if positions > room:
                    head = dataclasses.replace(forward, token_ids=forward.token_ids[:room])
                    rest = Forward(forward.key, forward.keep + room, forward.token_ids[room:], False)
                    batch.append((head, future, False))
                    left.append((rest, future))
                    room = 0
                    continue
                room -= positions
            batch.append((forward, future, True))
        if timed and not any(f.wants_logits for f, _, _ in batch):
            # While sessions play rounds, prefill rides with their rounds instead of taking passes of
            # its own: a round arriving behind a prefill-only pass would wait for all of it (on a CPU a
            # pass of one position costs about what a round does: it reads every weight).
            return [], [(f, fut) for f, fut in pending if not fut.done()]
        if timed:
            self._carry(batch, left)
        return batch, left + later

    async def _gather(self) -> None:
        # Sessions answered by the last batch come back after their edge's draft and a round trip;
        # without this wait they would form a second batch that alternates with the first.
        loop = asyncio.get_running_loop()
        window = min(self.config.window_s, self.config.window_fraction * self._last_batch_s)
        deadline = loop.time() + window
        wanted = min(len(self._open), self.config.max_batch)
        while len(self._pending) < wanted and (left := deadline - loop.time()) > 0:
            self._wake.clear()
            try:
                await within(self._wake.wait(), left)
            except TimeoutError:
                return

    def _measure(self, forwards: list[Forward], seconds: float) -> None:
        """Learns the rounds' time (from batches of rounds alone), and from a batch with prefill the cost
        of a prefill position (beside rounds: the batch's time over the rounds' alone), from which it
        sizes the next chunk (`_resize`): beside rounds, to the share of the rounds' time; in batches of
        prefill alone, to max_prefill_s."""
        positions = sum(len(f.token_ids) for f in forwards if not f.wants_logits)
        if positions == 0:
            self._round_s = _smooth(self._round_s, seconds)
            return
        c = self.config
        if any(f.wants_logits for f in forwards):
            if self._round_s:
                self._position_s = _costlier_first(self._position_s, (seconds - self._round_s) / positions)
                self._chunk = self._resize(
                    self._chunk, self._position_s, c.prefill_share * self._round_s, positions
                )
        elif c.max_prefill_s:
            self._idle_position_s = _costlier_first(self._idle_position_s, seconds / positions)
            self._idle_chunk = self._resize(
                self._idle_chunk, self._idle_position_s, c.max_prefill_s, positions
            )

    def _resize(self, chunk: float, position_s: float, budget_s: float, positions: int) -> float:
        """The next chunk: the positions `budget_s` pays for at `position_s` each, moving at most a factor
        of two from `chunk` a batch (a noisy batch moves it only so far), and growing only after a batch
        that filled it (a short prompt's last positions say nothing of what more would cost); between
        min_prefill_positions and max_prefill_positions (when set)."""
        c = self.config
        wanted = budget_s / position_s if position_s > 0 else 2 * chunk
        if positions < int(chunk):
            wanted = min(wanted, chunk)
        wanted = min(max(wanted, chunk / 2), 2 * chunk)
        if c.max_prefill_positions:
            wanted = min(wanted, float(c.max_prefill_positions))
        return max(float(c.min_prefill_positions), wanted)

    def prefill_room(self) -> tuple[int | None, bool]:
        """Prefill positions the next batch may run (None: no limit), and whether rounds' time bounds
        them: max_prefill_positions, and while sessions play rounds (one in the last ACTIVE_S) the chunk
        that keeps a mixed batch near (1 + prefill_share) × the rounds' time; while none does, the
        chunk that keeps a batch near max_prefill_s (`_measure`). Idle sessions slow a prefill down only
        to that bound."""
        c = self.config
        room = c.max_prefill_positions or None
        horizon = asyncio.get_running_loop().time() - ACTIVE_S
        active = any(at > horizon for at in self._rounds_at.values())
        if c.prefill_share and active and self._round_s:
            timed = int(self._chunk + self._credit)
            return (timed if room is None else min(room, timed)), True
        if room is not None and c.max_prefill_s:
            room = min(room, max(1, int(self._idle_chunk)))
        return room, False

    def _carry(self, batch: list, left: list) -> None:
        """A chunk under one position: a batch of rounds that left prefill waiting gathers the chunk for
        the next, and one that carried it starts again from nothing."""
        rounds = any(f.wants_logits for f, _, _ in batch)
        rode = any(not f.wants_logits for f, _, _ in batch)
        waiting = any(not f.wants_logits for f, _ in left)
        if self._chunk < 1 and rounds and waiting and not rode:
            self._credit += self._chunk
        else:
            self._credit = 0.0

    def calibrate(self, positions: int, prompt: int = 16) -> bool:
        """Times a round's forward of every size from 1 to `positions` after a short prompt, on a session
        of its own, into `stats.round_costs`: twice, keeping the second pass (the first warms the
        kernels up for each shape). Call it before serving and before the engine keeps finished
        caches. Costs a prompt's prefill and 2 · positions forwards, unless the config's
        calibration_dir holds this machine's figures already (`calibration_file`), which it then
        reads; a timing is written there. Returns whether it timed."""
        path = calibration_file(self.config.calibration_dir, self.engine, positions)
        kept = _read_figures(path, positions) if path else None
        if kept:
            for n, seconds in kept.items():
                self.stats.round_costs.observe(n, seconds)
            return False
        key, size = CALIBRATION_KEY, self.info.vocabulary.size
        ids = tuple(i % size for i in range(prompt + positions))
        figures = {}
        try:
            self.engine.forward_many([Forward(key, 0, ids[:prompt], wants_logits=False)])
            for timed in (False, True):
                for n in range(1, positions + 1):
                    start = time.perf_counter()
                    self.engine.forward_many([Forward(key, prompt, ids[prompt : prompt + n])])
                    if timed:
                        figures[n] = time.perf_counter() - start
                        self.stats.round_costs.observe(n, figures[n])
        finally:
            self.engine.release(key)
        if path:
            with contextlib.suppress(OSError):  # a read-only cache costs the next start a timing
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_suffix(".tmp")
                temporary.write_text(json.dumps({str(n): s for n, s in figures.items()}))
                temporary.replace(path)
        return True

    def _run_batch(self, forwards: list[Forward], releases: list[str]) -> list[torch.Tensor | None]:
        results = []
        if forwards:
            start = time.perf_counter()
            results = self.engine.forward_many(forwards)
            self._last_batch_s = time.perf_counter() - start
            self._measure(forwards, self._last_batch_s)
            self.stats.record([f.key for f in forwards], self._last_batch_s)
        for key in releases:
            self.engine.release(key)
            self.stats.last.pop(key, None)
        return results


def calibration_file(directory: str, engine: Engine, positions: int) -> Path | None:
    """Where `calibrate` keeps the figures of this engine on this machine: named by what sets a
    forward's time (the target, its numerics, torch's threads, the CPU's model, the sizes); None without
    a directory. Not by the padding of small calls: each load times the paddings and keeps the faster,
    which flips between starts only where the two are about as fast (SmolLM2 on an AMD EPYC: 2, then 4,
    then 2), and a flip cost the next start its figures (20-40 s of timing on a 1.5B target); the
    figures are a start, which the rounds served refine (VerifierSession.play)."""
    if not directory:
        return None
    key = "|".join(
        str(part)
        for part in (
            engine.info.target_id,
            engine.numerics.identity,
            torch.get_num_threads(),
            numerics_.cpu_model(),
            positions,
        )
    )
    return Path(directory) / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_figures(path: Path, positions: int) -> dict[int, float] | None:
    """Kept figures of every size 1..positions, or None (none kept, or unreadable)."""
    try:
        figures = {int(n): float(s) for n, s in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    complete = set(figures) == set(range(1, positions + 1))
    return figures if complete and all(0 < s < 3600 for s in figures.values()) else None


def _prefill_last(forward: Forward) -> tuple[bool, int]:
    """The order a batch takes sessions' oldest forwards in (sorted is stable: arrival order within a
    kind): rounds and bare forwards first, then prefills by the positions they have left."""
    prefill = not forward.wants_logits and bool(forward.token_ids)
    return prefill, len(forward.token_ids) if prefill else 0


def _costlier_first(old: float | None, new: float) -> float:
    """A prefill position's cost, updated: at once when the new figure is higher (a longer context costs
    more, and an overshoot delays rounds), smoothed when lower (one fast batch is often noise)."""
    new = max(new, 0.0)
    return new if old is None or new > old else _smooth(old, new)


def _smooth(old: float | None, new: float, weight: float = 0.5) -> float:
    """An exponential moving average's next value (the first measurement alone)."""
    return new if old is None else (1 - weight) * old + weight * new
