"""Prompt lookup replayed without the target: what a thin NGRAM session's rounds would be on outputs already
known (the capacity bench's references), by prompt kind and by drafting rule. `python -m
tools.bench.capacity --ngram-from REPORT` prints its table for a written report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftwire_cli.models.prompts import prompt_set


def replay(prompt, output, max_gamma: int, rule=None) -> dict:
    """What a thin NGRAM session does on a greedy session whose output is `output`, the verifier's rounds
    replayed without the target (its tokens are known): the verifier's draft (draftwire/ngram.py, its
    `rule`, the verifier's own by default; at most NGRAM_GAMMA and max_gamma tokens, none past the
    budget), the target's tokens, one round each. Greedy and EOS ignored, as in the bench, so it counts
    what the server counts."""
    from draftwire.ngram import NGRAM_GAMMA, RULE, ngram_draft

    rule = rule or RULE
    committed, output = list(prompt), list(output)
    rounds = drafts = draft_tokens = accepted_tokens = positions = 0
    while (done := len(committed) - len(prompt)) < len(output):
        budget = len(output) - done
        draft = ngram_draft(committed, min(NGRAM_GAMMA, max_gamma), rule)[: budget - 1]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[done + accepted]:
            accepted += 1
        committed += output[done : done + accepted + 1]
        rounds, positions = rounds + 1, positions + len(draft) + 1
        if draft:
            drafts, draft_tokens, accepted_tokens = (
                drafts + 1,
                draft_tokens + len(draft),
                accepted_tokens + accepted,
            )
    return {
        "tokens": len(output),
        "rounds": rounds,
        "drafts": drafts,  # rounds with a draft (a long enough match occurred before)
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted_tokens,
        "round_positions": positions,
    }


def breakdown(report: dict, prompts, eos_ids, kinds=None, rule=None) -> list[dict]:
    """Arm (b)'s prompt lookup (`rule`: draftwire.ngram's, by default) replayed on a report's reference
    outputs, by prompt kind (`kinds[i]`, or one kind for all): on the whole outputs (what the bench ran:
    EOS ignored, `new_tokens` each) and on the answers alone (each output up to and including its first
    id in `eos_ids`)."""
    from draftwire.ngram import RULE

    rule = rule or RULE
    gamma = report["config"]["gamma"] + 1  # the bench's verifier runs with --max-gamma γ + 1
    kinds = kinds or [report["config"].get("prompt_set", "all")] * len(prompts)
    groups: dict[str, list[tuple]] = {}
    for kind, prompt, output in zip(kinds, prompts, report["references"], strict=True):
        cut = next((i + 1 for i, t in enumerate(output) if t in eos_ids), len(output))
        groups.setdefault(kind, []).append((prompt, output, output[:cut]))
    if len(groups) > 1:
        groups["all"] = [g for group in list(groups.values()) for g in group]
    rows = []
    for kind, group in groups.items():
        for what, index in (("whole output", 1), ("answer", 2)):
            sums = totals([replay(g[0], g[index], gamma, rule) for g in group])
            rows.append({"rule": rule.label(), "kind": kind, "prompts": len(group), "part": what, **sums})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| rule | prompts | n | part | tokens | rounds | rounds with a draft | draft tokens | accepted "
        "| acceptance | tokens/round | round positions/token |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        acceptance = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(
            f"| {r['rule']} | {r['kind']} | {r['prompts']} | {r['part']} | {r['tokens']} | {r['rounds']} "
            f"| {r['drafts']} "
            f"| {r['draft_tokens']} | {r['accepted_tokens']} | {acceptance} | {r['tokens_per_round']:.2f} "
            f"| {r['round_positions_per_token']:.2f} |"
        )
    return "\n".join(lines)


def totals(replays: list[dict]) -> dict:
    """Sums of ngram_replay figures, with the acceptance, tokens per round and positions per token."""
    total = {k: sum(r[k] for r in replays) for k in replays[0]}
    return {
        **total,
        "acceptance": total["accepted_tokens"] / total["draft_tokens"] if total["draft_tokens"] else None,
        "tokens_per_round": total["tokens"] / total["rounds"],
        "round_positions_per_token": total["round_positions"] / total["tokens"],
    }


def rule_arg(text: str):
    """MIN,MAX,LAG (LAG '-': None) as an NgramRule."""
    from draftwire.ngram import NgramRule

    try:
        low, high, lag = text.split(",")
        return NgramRule(int(low), int(high), None if lag.strip() == "-" else int(lag))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN,MAX,LAG ({e})") from None


def breakdown_of_report(path: Path, target: Path, rules=None) -> list[dict]:
    """ngram_breakdown of a written report with each of `rules` (default: the rule the report was run
    with, then the verifier's current one if it differs), its prompts rebuilt from its prompt set with
    `target`'s tokenizer; the answer ends at the target's EOS ids (its config's and its tokenizer's).
    Raises ValueError if the report's own rule does not replay what it recorded."""
    from transformers import AutoConfig, AutoTokenizer

    from draftwire.ngram import ANY_1GRAM, RULE, NgramRule
    from draftwire_cli.models.prompts import CODE_PROMPT_KINDS

    report = json.loads(path.read_text())
    name = report["config"].get("prompt_set", "chat")
    prompts = prompt_set(name, target, report["prompts"])
    eos = AutoConfig.from_pretrained(target).eos_token_id
    eos_ids = {
        *(eos if isinstance(eos, list | tuple) else [eos]),
        AutoTokenizer.from_pretrained(target).eos_token_id,
    }
    kinds = CODE_PROMPT_KINDS if name == "code" else None
    # Reports written before the rule was recorded ran the verifier's first one: any 1-gram drafted.
    recorded = NgramRule(**report["ngram_rule"]) if "ngram_rule" in report else ANY_1GRAM
    own = breakdown(report, prompts, eos_ids - {None}, kinds, recorded)
    whole = next(r for r in own if r["kind"] in ("all", name) and r["part"] == "whole output")
    if whole["accepted_tokens"] != sum(g["accepted_tokens"] for g in report["ngram_by_prompt"]):
        raise ValueError(f"{path}: its outputs replay differently from what it recorded")
    rows = []
    for rule in rules or [recorded, *([RULE] if RULE != recorded else [])]:
        rows += own if rule == recorded else breakdown(report, prompts, eos_ids - {None}, kinds, rule)
    return rows
