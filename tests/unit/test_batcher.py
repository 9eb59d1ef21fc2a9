"""The batcher in process, over a fake engine: what runs together, what waits, and in which order."""

import asyncio
import dataclasses
import json
import time

from tools.testkit.fakes import FakeEngine
from verifier_service.batcher import BatchConfig, Batcher
from verifier_service.engine import Forward
from verifier_service.gamma_cap import GammaCap


def run(config: BatchConfig, scenario, engine: FakeEngine | None = None, gamma_cap: GammaCap | None = None):
    """Runs `scenario(batcher)` on a fresh batcher over a fake engine (a FakeEngine unless given), with
    `gamma_cap` if given; returns (its result, engine)."""
    engine = engine if engine is not None else FakeEngine()

    async def main():
        batcher = Batcher(engine, config, gamma_cap)
        try:
            return await scenario(batcher)
        finally:
            batcher.close()

    return asyncio.run(main()), engine


def test_forwards_queued_while_the_engine_is_busy_run_as_one_ragged_batch():
    async def scenario(batcher):
        for key in "abc":
            batcher.join(key)
        prefills = [Forward(k, 0, (1, 2, 3), wants_logits=False) for k in "abc"]
        await asyncio.gather(*(batcher.forward(f) for f in prefills))
        rounds = [Forward("a", 3, (4,)), Forward("b", 3, (4, 5, 6)), Forward("c", 3, (4, 5))]
        return await asyncio.gather(*(batcher.forward(f) for f in rounds))

    logits, engine = run(BatchConfig(window_s=0.05), scenario)
    assert [[f.key for f in b] for b in engine.batches] == [["a", "b", "c"], ["a", "b", "c"]]
    assert [tuple(x.shape) for x in logits] == [(1, 64), (3, 64), (2, 64)]  # each its own rows


def test_the_window_waits_for_open_sessions_and_a_lone_session_does_not_wait():
    async def scenario(batcher):
        batcher.engine.slow_s = 0.2  # the window is at most half the last batch's time: 0.1 s here
        batcher.join("a")
        start = time.perf_counter()
        await batcher.forward(Forward("a", 0, (1, 2), wants_logits=False))
        lone = time.perf_counter() - start - 0.2
        batcher.join("b")
        # b's forward arrives 20 ms after a's, inside the window: one batch.
        first = asyncio.ensure_future(batcher.forward(Forward("a", 2, (3,))))
        await asyncio.sleep(0.02)
        await asyncio.gather(first, batcher.forward(Forward("b", 0, (1,))))
        return lone

    lone, engine = run(BatchConfig(window_s=1.0), scenario)
    assert lone < 0.05
    assert [f.key for f in engine.batches[-1]] == ["a", "b"]


def test_one_forward_per_session_per_batch_in_arrival_order():
    async def scenario(batcher):
        batcher.join("a")
        await batcher.forward(Forward("a", 0, (1,), wants_logits=False))
        # Two forwards of one session queued together run in two batches, in order.
        await asyncio.gather(batcher.forward(Forward("a", 1, (2,))), batcher.forward(Forward("a", 2, (3,))))

    _, engine = run(BatchConfig(window_s=0), scenario)
    assert [[(f.key, f.keep) for f in b] for b in engine.batches] == [[("a", 0)], [("a", 1)], [("a", 2)]]


def test_a_release_runs_after_the_forwards_queued_before_it():
    async def scenario(batcher):
        batcher.join("a")
        pending = asyncio.ensure_future(batcher.forward(Forward("a", 0, (1, 2), wants_logits=False)))
        batcher.release("a")
        await pending
        await batcher.forward(Forward("z", 0, (1,), wants_logits=False))  # everything before has run
        return dict(batcher.engine.held)

    held, engine = run(BatchConfig(window_s=0), scenario)
    assert engine.released == ["a"] and "a" not in held


def test_an_engine_failure_reaches_its_forward_and_the_batcher_goes_on():
    async def scenario(batcher):
        for key in "ab":
            batcher.join(key)
        results = await asyncio.gather(
            batcher.forward(Forward("a", 5, (1,))),  # keeps more than it holds: the engine raises
            return_exceptions=True,
        )
        after = await batcher.forward(Forward("b", 0, (1,)))
        return results, after

    (results, after), _ = run(BatchConfig(window_s=0), scenario)
    assert isinstance(results[0], ValueError) and tuple(after.shape) == (1, 64)


class PositionCostEngine(FakeEngine):
    """A fake engine whose forward takes `per_position_s` for each position it computes."""

    per_position_s = 0.001

    def forward_many(self, forwards):
        time.sleep(self.per_position_s * sum(len(f.token_ids) for f in forwards))
        return super().forward_many(forwards)


def test_a_long_prefill_runs_in_chunks_and_a_round_queued_behind_it_joins_the_first():
    async def scenario(batcher):
        for key in "ab":
            batcher.join(key)
        await batcher.forward(Forward("a", 0, (1, 2, 3), wants_logits=False))
        long = batcher.forward(Forward("b", 0, tuple(range(1, 251)), wants_logits=False))
        return await asyncio.gather(long, batcher.forward(Forward("a", 3, (4,))))

    (prefill, round_logits), engine = run(BatchConfig(window_s=0, max_prefill_positions=100), scenario)
    assert prefill is None and round_logits is not None
    chunks = [f for b in engine.batches for f in b if f.key == "b"]
    assert [(f.keep, len(f.token_ids)) for f in chunks] == [(0, 100), (100, 100), (200, 50)]
    assert engine.held["b"] == 250  # the chunks add up to the whole prefill, in order
    assert sorted(f.key for f in engine.batches[1]) == ["a", "b"]  # the round did not wait for the rest


def test_with_no_round_played_a_prefill_batch_is_bounded_by_time_too():
    """No session plays rounds: after each batch the chunk becomes what max_prefill_s pays for at the
    cost a position just measured (1 ms here, the bound 30 ms), at most halving a batch, so a session
    opening meanwhile waits about 30 ms, not for chunks of max_prefill_positions; with the bound off (0)
    chunks stay at max_prefill_positions."""

    async def scenario(batcher):
        batcher.join("l")
        await batcher.forward(Forward("l", 0, tuple(range(1, 401)), wants_logits=False))

    def chunks(max_prefill_s):
        config = BatchConfig(window_s=0, max_prefill_positions=100, max_prefill_s=max_prefill_s)
        _, engine = run(config, scenario, PositionCostEngine())
        assert engine.held == {"l": 400}
        return [len(f.token_ids) for b in engine.batches for f in b]

    bounded = chunks(0.03)
    assert bounded[:2] == [100, 50] and all(25 <= n <= 30 for n in bounded[2:-1]), bounded
    assert chunks(0) == [100] * 4


def test_a_short_prompt_is_prefilled_before_the_chunks_left_of_a_long_one():
    """Fewest positions first: a 20-position prompt opened while a 1,000-position one runs in chunks of
    100 joins the next batch whole, first in the room, instead of waiting for the nine chunks left."""

    async def scenario(batcher):
        for key in "ls":
            batcher.join(key)
        long = asyncio.ensure_future(
            batcher.forward(Forward("l", 0, tuple(range(1, 1001)), wants_logits=False))
        )
        await asyncio.sleep(0)
        await batcher.forward(Forward("s", 0, tuple(range(1, 21)), wants_logits=False))
        await long

    _, engine = run(BatchConfig(window_s=0, max_prefill_positions=100), scenario)
    chunks = [[(f.key, len(f.token_ids)) for f in b] for b in engine.batches]
    short = next(i for i, b in enumerate(chunks) if ("s", 20) in b)
    assert short <= 1 and chunks[short] == [("s", 20), ("l", 80)], chunks  # in the first or the next batch
    assert engine.held == {"l": 1000, "s": 20}


def test_a_sessions_forwards_keep_their_order_whatever_their_kind():
    """A round queued behind its own session's prefill waits for it, though rounds go first."""

    async def scenario(batcher):
        batcher.join("a")
        prefill = batcher.forward(Forward("a", 0, tuple(range(1, 151)), wants_logits=False))
        await asyncio.gather(prefill, batcher.forward(Forward("a", 150, (7,))))

    _, engine = run(BatchConfig(window_s=0, max_prefill_positions=100), scenario)
    assert [[(f.keep, len(f.token_ids)) for f in b] for b in engine.batches] == [
        [(0, 100)],
        [(100, 50)],
        [(150, 1)],
    ]


def test_calibration_is_kept_for_the_next_start_of_the_same_engine_here(tmp_path):
    """A start times the round sizes once and keeps them by target, numerics, threads and CPU: the next
    start of the same engine reads them and runs no forward (a busy machine's start-up times nothing);
    another numerics identity, or kept figures that lack a size, time again."""
    config = BatchConfig(calibration_dir=str(tmp_path))

    def start(engine: FakeEngine) -> tuple[bool, dict[int, float]]:
        batcher = Batcher(engine, config)
        try:
            return batcher.calibrate(5), dict(batcher.stats.round_costs.means)
        finally:
            batcher.close()

    first = FakeEngine()
    timed, figures = start(first)
    assert timed and sorted(figures) == [1, 2, 3, 4, 5] and first.batches
    second = FakeEngine()
    timed, kept = start(second)
    assert not timed and kept == figures and not second.batches
    padded = FakeEngine()  # another padding of small calls than the first start's (a FakeEngine has none)
    padded.padding = 4
    timed, kept = start(padded)
    assert not timed and kept == figures
    other = FakeEngine()
    other.numerics = dataclasses.replace(other.numerics, dtype="bfloat16")
    assert start(other)[0]
    (path,) = [
        p for p in tmp_path.iterdir() if json.loads(p.read_text()) == {str(n): s for n, s in figures.items()}
    ]
    path.write_text(json.dumps({"1": 0.1}))
    assert start(FakeEngine())[0]
