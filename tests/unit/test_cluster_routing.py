"""Routing and scaling decisions of the pool, as tables: no Ray, no gRPC."""

from pathlib import Path

import pytest

from cluster.config import PoolConfig, ReplicaConfig, ScalingConfig, placed
from cluster.routing import Autoscaler, RoutingTable, State, soonest


def table_with(*states: State) -> RoutingTable:
    table = RoutingTable()
    for i, state in enumerate(states):
        table.add(f"r{i}")
        if state is not State.STARTING:
            table.live(f"r{i}", f"127.0.0.1:{9000 + i}")
        if state is State.DOWN:
            table.down(f"r{i}")
        if state is State.DRAINING:
            table.drain(f"r{i}")
    return table


def test_new_sessions_go_to_the_least_loaded_live_replica():
    table = table_with(State.LIVE, State.LIVE, State.LIVE)
    picks = [table.acquire().name for _ in range(6)]
    assert sorted(picks) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    table.release(table.slots["r1"])
    table.release(table.slots["r1"])
    assert table.acquire().name == "r1"


def test_ties_rotate_instead_of_piling_on_the_first_replica():
    table = table_with(State.LIVE, State.LIVE)
    names = []
    for _ in range(4):  # one session at a time: each ends before the next opens
        slot = table.acquire()
        names.append(slot.name)
        table.release(slot)
    assert names == ["r0", "r1", "r0", "r1"]


@pytest.mark.parametrize("state", [State.STARTING, State.DOWN, State.DRAINING])
def test_only_live_replicas_get_new_sessions(state):
    table = table_with(state, State.LIVE)
    assert {table.acquire().name for _ in range(3)} == {"r1"}
    assert table_with(state).acquire() is None


def test_a_draining_replica_keeps_its_sessions_and_a_death_does_not_undrain_it():
    table = table_with(State.LIVE, State.LIVE)
    first = table.acquire()
    table.drain(first.name)
    table.down(first.name)
    assert first.state is State.DRAINING and first.sessions == 1
    assert table.sessions == 1


def test_a_session_refused_by_a_replica_goes_to_the_next_one_not_yet_tried():
    table = table_with(State.LIVE, State.LIVE, State.LIVE)
    table.acquire()  # r0: one session; r1 and r2 are the least loaded
    tried = set()
    for expected in ("r1", "r2", "r0"):  # the least loaded of the others each time, the busy one last
        slot = table.acquire(exclude=tried)
        assert slot.name == expected
        table.release(slot)  # it refused: the session is not counted there
        tried.add(slot.name)
    assert table.acquire(exclude=tried) is None  # every live replica refused
    assert [s.sessions for s in table.slots.values()] == [1, 0, 0]


def test_exclusion_never_makes_a_replica_that_is_not_live_routable():
    table = table_with(State.LIVE, State.DRAINING, State.DOWN, State.STARTING)
    assert table.acquire(exclude={"r0"}) is None
    assert table.pick(exclude={"r1"}).name == "r0"


@pytest.mark.parametrize(
    "hints, expected",
    [
        ([1000], 0),
        ([1000, 250, 4000], 1),  # the smallest hint
        ([None, 3000], 1),  # a refusal without a hint comes after any with one
        ([None, None], 0),
        ([500, 500], 0),  # equal hints: the first replica's
    ],
)
def test_an_edge_that_every_replica_refused_gets_the_soonest_retry(hints, expected):
    assert soonest(hints) == expected


SCALING = ScalingConfig(min_replicas=1, max_replicas=4, target_sessions_per_replica=2, downscale_delay_s=10)


@pytest.mark.parametrize(
    "open_sessions, current, now, expected",
    [
        (0, 1, 0.0, 1),  # never below the minimum
        (2, 1, 0.0, 1),  # exactly the target per replica
        (3, 1, 0.0, 2),  # up at once
        (7, 2, 0.0, 4),
        (100, 2, 0.0, 4),  # never above the maximum
    ],
)
def test_autoscaler_up_at_once_within_bounds(open_sessions, current, now, expected):
    assert Autoscaler(SCALING).decide(open_sessions, current, now) == expected


def test_autoscaler_goes_down_only_after_the_load_stayed_low():
    scaler = Autoscaler(SCALING)
    assert scaler.decide(1, 3, now=0.0) == 3  # low since t=0
    assert scaler.decide(1, 3, now=9.0) == 3
    assert scaler.decide(1, 3, now=10.0) == 1
    assert scaler.decide(1, 3, now=11.0) == 3  # the clock started over after the decision
    assert scaler.decide(6, 3, now=12.0) == 3  # back up: the low spell is forgotten
    assert scaler.decide(1, 3, now=13.0) == 3
    assert scaler.decide(1, 3, now=22.9) == 3
    assert scaler.decide(1, 3, now=23.0) == 1


def test_scaling_config_refuses_impossible_bounds():
    with pytest.raises(ValueError):
        ScalingConfig(min_replicas=2, max_replicas=1)
    with pytest.raises(ValueError):
        ScalingConfig(min_replicas=0, max_replicas=1)


def pool(gpus: float | None, low: int | None, high: int | None) -> PoolConfig:
    return PoolConfig(ReplicaConfig(Path("target"), num_gpus=gpus), ScalingConfig(low, high))


@pytest.mark.parametrize(
    ("asked", "cluster_gpus", "placed_as"),
    [
        # (num_gpus, min, max) asked -> (num_gpus, min, max) on a cluster with this many GPUs
        ((None, None, None), 0, (0.0, 1, 1)),  # the defaults on a CPU cluster: one CPU replica
        ((None, None, None), 8, (1.0, 8, 8)),  # on 8 GPUs: a replica per GPU
        ((None, None, 4), 8, (1.0, 4, 4)),  # --max-replicas caps the replicas per GPU
        ((None, None, 16), 8, (1.0, 8, 16)),  # and autoscales above them (Ray's autoscaler adds GPUs)
        ((0.5, None, None), 2, (0.5, 4, 4)),  # two replicas share each GPU
        ((None, 2, 6), 8, (1.0, 2, 6)),  # counts given are kept
        ((0.0, None, None), 8, (0.0, 1, 1)),  # CPU replicas on a GPU cluster
        ((None, None, None), 0.5, (0.0, 1, 1)),  # less than a GPU: none to give a replica
    ],
)
def test_replicas_are_placed_one_per_gpu_by_default(asked, cluster_gpus, placed_as):
    config = placed(pool(*asked), cluster_gpus)
    assert (config.replica.num_gpus, config.scaling.min_replicas, config.scaling.max_replicas) == placed_as


def test_placed_counts_are_checked():
    with pytest.raises(ValueError, match="replicas"):
        placed(pool(None, 4, 2), 8)
