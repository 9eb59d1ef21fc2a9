"""The verifier's figures are declared once (draftwire/counters.py): the table and ServerStats name the
same fields, a pool's front combines replicas' figures as the table says, the metrics come from it, and
docs/metrics.md documents each."""

from pathlib import Path

from cluster.front import add_stats
from draftwire.contract import BATCH_SECONDS_BUCKETS, BATCH_SIZE_BUCKETS
from draftwire.counters import STATS
from draftwire.metrics import families
from draftwire.v1 import draftwire_pb2 as pb
from verifier_service.session import VerifierStats

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_and_serverstats_name_the_same_fields_once():
    fields = [f.name for f in pb.ServerStats.DESCRIPTOR.fields]
    assert sorted(s.field for s in STATS) == sorted(fields)
    assert len({s.name for s in STATS if s.metric}) == len([s for s in STATS if s.metric])


def test_every_session_counter_is_a_serverstats_field_the_servicer_copies():
    assert set(VerifierStats.__dataclass_fields__) <= {s.field for s in STATS}


def replica(scale: int, gamma_cap: int, identity: str) -> pb.ServerStats:
    """Every scalar field set (scale times its place in the table), lists, a refusal and a numerics."""
    stats = pb.ServerStats(
        accepted_per_position=[scale] * scale,
        batch_seconds_counts=[scale] * (len(BATCH_SECONDS_BUCKETS) + 1),
        batch_size_counts=[1] * (len(BATCH_SIZE_BUCKETS) + 1),
        gamma_cap=gamma_cap,
        numerics=[pb.Numerics(identity=identity)],
    )
    for i, stat in enumerate(STATS):
        if stat.pool == "sum" and isinstance(getattr(stats, stat.field), int | float):
            setattr(stats, stat.field, scale * (i + 1))
    stats.refusals["UNAVAILABLE"] = scale
    return stats


def test_a_pool_sums_counters_lists_and_maps_takes_the_lowest_cap_and_each_numerics_once():
    total = pb.ServerStats()
    for r in (replica(1, 0, "a"), replica(2, 5, "b"), replica(3, 3, "a")):
        add_stats(total, r)
    for i, stat in enumerate(STATS):
        if stat.pool == "sum" and isinstance(getattr(total, stat.field), int | float):
            assert getattr(total, stat.field) == 6 * (i + 1), stat.field
    assert list(total.accepted_per_position) == [6, 5, 3]
    assert list(total.batch_seconds_counts) == [6] * (len(BATCH_SECONDS_BUCKETS) + 1)
    assert list(total.batch_size_counts) == [3] * (len(BATCH_SIZE_BUCKETS) + 1)
    assert dict(total.refusals) == {"UNAVAILABLE": 6}
    assert total.gamma_cap == 3  # the lowest set; a replica with none (0) does not count
    assert [n.identity for n in total.numerics] == ["a", "b"]
    assert total.target_positions_per_token == 0  # a ratio: the front computes it from the sums


def test_each_table_metric_is_exported_with_its_value_and_documented():
    stats = replica(1, 4, "a")
    exported = {f.name: f for f in families(stats)}
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for stat in (s for s in STATS if s.metric):
        family = exported["draftwire:" + stat.name]
        assert family.type == stat.metric and family.samples[0].value == getattr(stats, stat.field)
        suffix = "_total" if stat.metric == "counter" else ""
        assert f"`draftwire:{stat.name}{suffix}`" in doc, stat.name
