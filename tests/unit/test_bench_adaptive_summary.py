"""The adaptive bench's summary over interleaved passes (tools.bench.adaptive --repeats): a setting's
figure at a point is its median over the passes, the adaptive row is compared with the best fixed
setting pass by pass, and the fixed rows' spread is reported. Hand-made rows; the bench's real run is
tests/system/test_bench_adaptive.py."""

import dataclasses
from pathlib import Path

import pytest

from edge_client.adaptive import Tuner, path_rounds
from edge_client.speed_model import tokens_per_second
from tools.bench.adaptive import across, across_markdown, far_of_near, markdown, summarize
from tools.bench.arms import BenchConfig, Row
from tools.bench.speed import model_at_own_acceptance, rate_of_acceptance, tuner_view

OUT = [[1, 2, 3]]


def row(setting, rate, repeat, label="draftwire"):
    gamma, depth = setting
    return Row(
        "c",
        label,
        "greedy",
        gamma,
        0.0,
        depth,
        tokens=int(rate * 100),
        wall_s=100.0,
        repeat=repeat,
        outputs=OUT,
    )


def test_medians_over_passes_pick_the_best_and_compare_pass_by_pass():
    config = BenchConfig(Path("t"), Path("d"), None, ((1, 2),), rtts_ms=(0,))
    adaptive = "draftwire, adaptive (ended at γ 2, depth 1; 3 moves)"
    by_pass = {  # tokens/s: pass 0, 1, 2
        (2, 0): (4.0, 3.0, 3.8),  # median 3.8: the best fixed setting
        (4, 0): (4.4, 3.2, 3.6),  # the best single figure, but median 3.6
        (0, -1): (3.7, 3.1, 3.65),  # adaptive: median 3.65
    }
    rows = [
        row(s, rates[p], p, adaptive if s == (0, -1) else "draftwire")
        for p in range(3)
        for s, rates in by_pass.items()
    ]
    report = summarize(
        config, {"greedy": Row("a", "alone", "greedy", tokens=200, wall_s=100.0, outputs=OUT)}, rows
    )
    (point,) = report["points"]
    assert report["passes"] == point["passes"] == 3
    assert point["best_fixed"] == [2, 0] and point["best_fixed_tokens_per_s"] == pytest.approx(3.8)
    assert point["adaptive_tokens_per_s"] == pytest.approx(3.65)
    assert point["of_best"] == pytest.approx(3.65 / 3.8) and point["within"]
    assert point["of_best_by_pass"] == pytest.approx([3.7 / 4.0, 3.1 / 3.0, 3.65 / 3.8])
    # (4.0 - 3.0) / 3.8 and (4.4 - 3.2) / 3.6: their median
    assert point["fixed_spread"] == pytest.approx((1.0 / 3.8 + 1.2 / 3.6) / 2)
    assert point["rank"] == 1 + 1  # only (2, 0)'s median is above the adaptive one
    assert point["adaptive_ended"] == ["ended at γ 2, depth 1; 3 moves"] * 3
    assert report["overall"]["fixed"]["4,0"]["sum"] == pytest.approx(3.6)
    assert len(report["exact"]) == 9 and all(report["exact"].values())
    assert "greedy/rtt0/adaptive/pass3" in report["exact"]
    table = markdown(report)
    assert "median of 3 interleaved passes" in table
    assert "| (2, 1), (2, 1), (2, 1) |" in table and "| 0.93, 1.03, 0.96 |" in table


def test_one_pass_keeps_the_plain_table():
    config = BenchConfig(Path("t"), Path("d"), None, ((1, 2),), rtts_ms=(0,))
    adaptive = row((0, -1), 3.9, 0, "draftwire, adaptive (ended at γ 2, depth 0; 1 moves)")
    adaptive.tuner_path = path_rounds([(0, 4, 2), (7, 2, 0)], 40)
    rows = [row((2, 0), 4.0, 0), adaptive]
    report = summarize(
        config, {"greedy": Row("a", "alone", "greedy", tokens=200, wall_s=100.0, outputs=OUT)}, rows
    )
    (point,) = report["points"]
    assert point["fixed_spread"] == 0 and point["of_best_by_pass"] == pytest.approx([3.9 / 4.0])
    assert "exact" in report and "greedy/rtt0/adaptive" in report["exact"]
    table = markdown(report)
    assert "pass by pass" not in table and "| 0 | greedy | 3.90 | ended at γ 2, depth 0; 1 moves |" in table
    assert point["adaptive_paths"] == [[[4, 2, 7], [2, 0, 33]]]
    assert "| 0 | greedy | (4, 2)×7 → (2, 0)×33 |" in table


def test_across_classes_the_one_default_against_each_fixed_setting_measured_everywhere():
    """Two classes whose best fixed settings differ: each fixed setting loses somewhere, and the
    adaptive row, second in each class, is ahead over the set. A setting measured in one class only
    (γ 6) is left out of the set."""
    config = BenchConfig(Path("t"), Path("d"), None, ((1, 2),), rtts_ms=(0,))
    alone = {"greedy": Row("a", "alone", "greedy", tokens=200, wall_s=100.0, outputs=OUT)}
    adaptive = "draftwire, adaptive (ended at γ 4, depth 0; 1 moves)"

    def report(rates):
        rows = [row(s, r, 0, adaptive if s == (0, -1) else "draftwire") for s, r in rates.items()]
        return summarize(config, alone, rows)

    reports = {
        "haiku": report({(2, 0): 4.0, (4, 2): 3.0, (0, -1): 3.9}),
        "chat": report({(2, 0): 5.0, (4, 2): 7.0, (6, 0): 9.0, (0, -1): 6.8}),
    }
    assert not reports["chat"]["overall"]["beats_every_fixed_by_sum"]  # γ 6 wins chat alone
    result = across(reports)
    o = result["overall"]
    assert set(o["fixed"]) == {"2,0", "4,2"}
    assert o["adaptive"]["sum"] == pytest.approx(10.7) and o["fixed"]["4,2"]["sum"] == pytest.approx(10.0)
    assert o["adaptive"]["geomean"] == pytest.approx((3.9 * 6.8) ** 0.5)
    assert o["beats_every_fixed_by_sum"] and o["beats_every_fixed_by_geomean"]
    assert not o["within_at_every_point"]  # chat: 6.8 against γ 6's 9.0
    assert [(p["class"], p["within"]) for p in result["points"]] == [("haiku", True), ("chat", False)]
    table = across_markdown(result)
    assert "2 points: haiku, chat" in table and "| chat | 0 | greedy | 0.76 | no | 3.40× |" in table
    assert "by sum yes (best fixed 4,2)" in table
    disjoint = {"haiku": reports["haiku"], "code": report({(6, 0): 5.0, (0, -1): 4.8})}
    with pytest.raises(ValueError, match="share no fixed"):
        across(disjoint)


def test_the_step_rules_row_is_compared_with_the_models_and_not_taken_for_a_fixed_setting():
    """A run with both adaptive rows (--rules model,step): the step rule's row (pipeline -2) is no
    fixed setting, so it is never the best fixed one; over the set it is read against the model's."""
    config = BenchConfig(Path("t"), Path("d"), None, ((1, 2),), rtts_ms=(0,))
    alone = {"greedy": Row("a", "alone", "greedy", tokens=200, wall_s=100.0, outputs=OUT)}
    adaptive = "draftwire, adaptive (ended at γ 4, depth 2; 1 moves)"

    def report(rates):
        rows = [row(s, r, 0, adaptive if s[1] < 0 else "draftwire") for s, r in rates.items()]
        return summarize(config, alone, rows)

    reports = {
        "haiku": report({(4, 2): 3.0, (0, -1): 3.9, (0, -2): 4.5}),
        "chat": report({(4, 2): 7.0, (0, -1): 6.8, (0, -2): 6.0}),
    }
    (point,) = reports["haiku"]["points"]
    assert point["best_fixed"] == [4, 2] and point["rank"] == 1 and point["step_tokens_per_s"] == 4.5
    assert "greedy/rtt0/step" in reports["haiku"]["exact"]
    o = across(reports)["overall"]
    assert set(o["fixed"]) == {"4,2"}
    assert o["step"]["sum"] == pytest.approx(10.5) and o["adaptive"]["sum"] == pytest.approx(10.7)
    assert o["step_of_model"]["sum"] == pytest.approx(10.5 / 10.7)
    assert o["step_of_model"]["geomean"] == pytest.approx((4.5 * 6.0) ** 0.5 / (3.9 * 6.8) ** 0.5)
    table = across_markdown(across(reports))
    assert "| adaptive, step rule | 10.5 |" in table and "over the model's: 0.981 by sum" in table


def test_far_of_near_is_each_class_and_modes_longest_rtt_over_its_shortest():
    def point(cls, mode, rtt, rate, fixed=None):
        return {
            "class": cls,
            "mode": mode,
            "rtt_ms": rtt,
            "adaptive_tokens_per_s": rate,
            "fixed_tokens_per_s": fixed or {},
        }

    points = [
        point("chat", "greedy", 30, 4.5, {"2,0": 3.0, "4,2": 4.0, "6,0": 2.0}),
        point("chat", "greedy", 0, 5.0, {"2,0": 4.0, "4,2": 5.0, "6,0": 2.0}),
        point("chat", "sampled", 0, 4.0),
        point("code", "greedy", 0, 6.0),
        point("code", "greedy", 30, 6.6),
    ]
    rows = far_of_near(points)
    assert [(r["class"], r["mode"], r["rtts_ms"]) for r in rows] == [
        ("chat", "greedy", [0, 30]),
        ("code", "greedy", [0, 30]),
    ]  # chat sampled has one RTT: nothing to compare
    assert [r["ratio"] for r in rows] == pytest.approx([0.9, 1.1])
    assert rows[0]["fixed_ratio"] == pytest.approx(0.8) and rows[1]["fixed_ratio"] is None  # 0.75, 0.8, 1


def test_the_longer_rtts_figures_over_loopbacks_pass_by_pass_beside_the_fixed_settings():
    """With --rtts-together a pass's rows at both RTTs took turns: the defaults' ratio pass by pass is
    then free of the machine's drift, which the fixed settings' own ratio shows."""
    config = BenchConfig(Path("t"), Path("d"), None, ((1, 2),), rtts_ms=(0, 30))
    rates = {  # (setting, RTT): tokens/s in pass 0, 1, 2
        ((0, -1), 0): (5.0, 4.0, 6.0),
        ((0, -1), 30): (4.5, 3.8, 5.4),  # 0.90, 0.95, 0.90 pass by pass; medians 4.5 of 5.0
        ((2, 0), 0): (4.0, 4.0, 4.0),
        ((2, 0), 30): (3.0, 3.2, 3.4),  # median 3.2: 0.8
    }
    rows = []
    for p in range(3):
        for (setting, rtt), figures in rates.items():
            label = "draftwire, adaptive (ended at γ 2, depth 0; 1 moves)" if setting == (0, -1) else "x"
            r = row(setting, figures[p], p, label)
            r.rtt_ms = float(rtt)
            rows.append(r)
    alone = {"greedy": Row("a", "alone", "greedy", tokens=200, wall_s=100.0, outputs=OUT)}
    report = summarize(config, alone, rows, rtts_together=True)
    (ratio,) = report["far_of_near"]
    assert ratio["rtts_ms"] == [0, 30] and ratio["ratio"] == pytest.approx(4.5 / 5.0)
    assert ratio["by_pass"] == pytest.approx([0.9, 0.95, 0.9]) and ratio["fixed_ratio"] == pytest.approx(0.8)
    table = markdown(report)
    assert "took turns in each pass" in table
    assert "| greedy | 30 of 0 | 0.90 | 0.90, 0.95, 0.90 | 0.80 |" in table


@pytest.mark.parametrize("alpha, gamma", [(0.8, 4), (0.35, 2), (0.97, 6)])
def test_the_rate_of_an_acceptance_accepts_it_on_average(alpha, gamma):
    acceptance = sum(alpha**k for k in range(1, gamma + 1)) / gamma
    assert rate_of_acceptance(acceptance, gamma) == pytest.approx(alpha, abs=1e-6)


def test_the_model_at_a_rows_own_acceptance_reads_back_the_tuners_costs():
    """A bench row's JSON keeps what its tuner held (tuner_view); the model rebuilt from it, at the row's
    acceptance as one rate at every position, is the tuner's own model at that rate; the adaptive row's
    setting is where its path ended."""
    tuner = Tuner()
    figures = [(4, False, 0.09, 0.21), (4, True, 0.11, 0.24), (6, True, 0.15, 0.3)]
    for gamma, ahead, draft_s, verify_s in figures:
        tuner.observe_draft(gamma + ahead, draft_s, ahead=ahead)
        tuner.observe_verify(gamma, verify_s, beside=float(ahead))
    tuner.observe_round(0.25, 0.21, queued=False)
    acceptance, alpha = 0.5904, 0.8  # γ 4 at α 0.8
    est = dataclasses.replace(tuner.estimates(), acceptance=(alpha,) * len(tuner.acceptance()))
    fixed = {"tuner": tuner_view(tuner), "acceptance": acceptance, "tuner_rtt_ms": 1000 * tuner.rtt_s}
    for setting in [(4, 0), (4, 2)]:
        row = {**fixed, "gamma": setting[0], "pipeline": setting[1]}
        assert model_at_own_acceptance(row) == pytest.approx(tokens_per_second(est, *setting), rel=1e-3)
    adaptive = {**fixed, "gamma": 0, "pipeline": -1, "tuner_path": [[4, 2, 5], [4, 0, 9]]}
    assert model_at_own_acceptance(adaptive) == pytest.approx(tokens_per_second(est, 4, 0), rel=1e-3)
    assert model_at_own_acceptance({**fixed, "tuner": None, "gamma": 4, "pipeline": 0}) is None
