"""A smoke run of the capacity benchmark on the committed demo pair, so that it cannot rot: its figures
agree with each other and every arm commits the target alone's output."""

import asyncio
from pathlib import Path

import pytest

from draftwire_cli.models.prompts import heldout_prompts
from tools.bench import capacity

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_capacity_benchmark_figures_agree(tmp_path):
    config = capacity.CapacityConfig(
        target_dir=DEMO / "target",
        draft_gguf=DEMO / "draft-q8_0.gguf",
        prompts=heldout_prompts(DEMO / "target", 2, 32),
        sessions=(1, 2),
        new_tokens=12,
        live_max=1,
        verifier_cpus=(),  # this process keeps its cores: the figures, not the rig, are under test
        edge_cpus=(),
    )
    report = asyncio.run(capacity.run_all(config, log=lambda _: None))
    rows = report["rows"]
    cells = [(r["sessions"], r["arm"], r["drafts"]) for r in rows]
    assert cells == [
        (1, "a", ""),
        (1, "b", ""),
        (1, "c", "replayed"),
        (1, "c", "live"),
        (2, "a", ""),
        (2, "b", ""),
        (2, "c", "replayed"),
    ]
    for r in rows:
        assert r["exact"], r  # the same target text whatever drafts it
        assert r["tokens"] == r["sessions"] * config.new_tokens == r["server_tokens"]
        assert r["served_tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["upload_bytes_per_token"] > 0 and r["download_bytes_per_token"] > 0
        # Prefill counted, no cache kept: all but the last prompt token (the first round computes that one).
        assert r["prefill_positions"] == r["sessions"] * 31
        assert r["bound_tokens_per_s"] >= r["served_tokens_per_s"]
    for r in rows:
        if r["arm"] == "b":  # the offline replay of prompt lookup counts what the server counted
            replay = r["ngram_replay"]
            assert replay["rounds"] == r["rounds"] and replay["tokens"] == r["tokens"]
            assert replay["acceptance"] == r["acceptance"]
            round_positions = r["positions_per_token"] * r["tokens"] - r["prefill_positions"]
            assert replay["round_positions"] == pytest.approx(round_positions)
    assert len(report["ngram_by_prompt"]) == len(report["references"]) == len(config.prompts)
    for n in (1, 2):
        a, b, c = (next(r for r in rows if r["sessions"] == n and r["arm"] == arm) for arm in "abc")
        # Rounds, not session forwards: a prompt's prefill is cut into as many chunks as the round time
        # measured while other sessions play leaves room for, so the forwards per token vary from run to
        # run (a fresh-clone CI run counted 1.08 for the target alone and 1.38 for prompt lookup).
        assert a["tokens_per_round"] == 1.0  # the target alone: one token per round
        assert c["tokens_per_round"] > a["tokens_per_round"]
        # Prompt lookup drafts only after a 4-token match: on 12 tokens of the demo pair it may never.
        assert b["tokens_per_round"] >= a["tokens_per_round"]
        assert a["upload_bytes_per_token"] < c["upload_bytes_per_token"]  # thin: the open alone goes up
    assert (
        report["ratios"]["c/replayed/N2"] == rows[6]["served_tokens_per_s"] / rows[4]["served_tokens_per_s"]
    )
    table = capacity.write_outputs(report, tmp_path)
    assert (tmp_path / "capacity.png").stat().st_size > 0 and "| 2 | (c)" in table


def test_prompt_set_option_picks_the_code_turns():
    """`--prompt-set code` runs the held-out code turns, rendered with the target's chat template;
    `--arms ab` leaves the edge arm (and its draft recording) out."""
    from draftwire_cli.models.prompts import CODE_PROMPTS, code_prompts, prompt_set

    args = ["--target", str(DEMO / "target"), "--prompt-set", "code", "--prompts", "3", "--arms", "ab"]
    config = capacity.config_from_args(capacity.parser().parse_args(args))
    assert config.prompt_set == "code" and config.arms == "ab"
    assert config.prompts == code_prompts(DEMO / "target", 3) == prompt_set("code", DEMO / "target")[:3]
    assert len(prompt_set("code", DEMO / "target")) == len(CODE_PROMPTS) >= 12
    chat = capacity.config_from_args(capacity.parser().parse_args(["--target", str(DEMO / "target")]))
    assert chat.prompt_set == "chat" and chat.arms == "abc" and len(chat.prompts) == 24
    assert not set(chat.prompts) & set(prompt_set("code", DEMO / "target"))
    with pytest.raises(SystemExit):
        capacity.parser().parse_args(["--prompt-set", "poetry"])
    with pytest.raises(ValueError):
        prompt_set("code", DEMO / "target", len(CODE_PROMPTS) + 1)
