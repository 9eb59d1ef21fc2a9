"""`draftwire loadtest`: many concurrent sessions, edge or thin: throughput, latency, errors, per kind.

The drafter replays the target's own greedy continuation of each prompt, with a share `corrupt` of the
draft tokens replaced (edge_client.replay.ReplayDrafter). The continuations are recorded through the
server under test before the load: a session whose proposals are random still commits exactly the
target's tokens, so the client needs no model and drafting costs it nothing; one machine drives many
sessions. Thin sessions (`drafting` none or ngram) send the prompt alone and the verifier decodes them,
with the target alone or its own prompt-lookup drafts; `mix` makes every third session of each kind.
Every generation under load must reproduce its recording; a difference counts as a mismatch.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Literal

import grpc

from draftwire.contract import Drafting
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire.vocab import Vocabulary
from draftwire_cli.figures import percentile
from draftwire_cli.models.prompts import id_prompts
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, VerifierError


@dataclass(frozen=True)
class LoadConfig:
    sessions: int = 16  # concurrent edge sessions, each opening a new generation when one ends
    duration_s: float = 30.0  # no generation starts after this; those running finish
    gamma: int = 4  # draft tokens per proposal
    pipeline: int = 0  # proposals each session sends ahead of their verdicts
    new_tokens: int = 32  # tokens each generation commits (EOS ignored, so every one is this long)
    corrupt: float = 0.2  # share of draft tokens replaced: sets the acceptance rate
    prompts: int = 8  # distinct prompts, recorded once
    prompt_tokens: int = 16
    drafting: Literal["edge", "none", "ngram", "mix"] = "edge"  # who drafts; mix: sessions take turns

    def kind(self, worker: int) -> Drafting:
        """Who drafts for the generations of session `worker`."""
        if self.drafting == "mix":
            return list(Drafting)[worker % len(Drafting)]
        return Drafting(self.drafting)


async def record(channel: grpc.aio.Channel, config: LoadConfig) -> tuple[Vocabulary, list[tuple]]:
    """(vocabulary, [(prompt, the target's continuation)]) through the server itself.

    Raises VerifierError or grpc.aio.AioRpcError when the server refuses or cannot be reached.
    """
    info = await pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())
    vocab = Vocabulary(info.vocab_size, info.tokenizer_fingerprint)
    prompts = id_prompts(info.vocab_size, config.prompts, config.prompt_tokens)

    async def one(prompt):
        drafter = ReplayDrafter(prompt, vocab, corrupt=1.0)  # random proposals: the target's own tokens
        ids, _ = await EdgeSession(channel, drafter).run(_request(prompt, config, Drafting.EDGE))
        return prompt, tuple(ids)

    return vocab, list(await asyncio.gather(*(one(p) for p in prompts)))


async def _generate_once(channel, config: LoadConfig, kind: Drafting, prompt, script, vocab, seed: int):
    """One generation of a worker's loop: (its counters, its stats, the error's status name or None)."""
    drafter = None
    if kind is Drafting.EDGE:
        drafter = ReplayDrafter(prompt + script, vocab, config.corrupt, seed=seed)
    session = EdgeSession(channel, drafter, vocabulary=vocab)
    stats, ids = GenerationStats(), []
    try:
        async for _ in session.generate(_request(prompt, config, kind), stats, ids):
            pass
    except VerifierError as e:
        return {"errors": 1}, stats, e.code.name
    except grpc.aio.AioRpcError as e:
        return {"errors": 1}, stats, e.code().name
    return {"generations": 1, "mismatches": int(tuple(ids) != script)}, stats, None


async def run_load(channel: grpc.aio.Channel, config: LoadConfig) -> dict:
    """Records the continuations, then runs `sessions` concurrent loops for `duration_s`; the report."""
    vocab, scripts = await record(channel, config)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.duration_s
    rounds: list[float] = []  # edge sessions' send-to-verdict times (a thin session sends no proposal)
    errors: collections.Counter[str] = collections.Counter()
    totals = collections.Counter()
    kinds: dict[str, dict] = {}  # per kind: its counters, TTFTs and generations' tokens/s

    async def worker(w: int) -> None:
        kind = config.kind(w)
        mine = kinds.setdefault(kind.value, {"totals": collections.Counter(), "ttft": [], "rates": []})
        for n in range(1_000_000):
            if loop.time() >= deadline:
                return
            prompt, script = scripts[(w + n) % len(scripts)]
            done, stats, error = await _generate_once(
                channel, config, kind, prompt, script, vocab, seed=w * 100_003 + n
            )
            if error is not None:
                errors[error] += 1
            else:
                mine["rates"].append(stats.generated_tokens / stats.wall_s)
            rounds.extend(stats.round_s)
            if stats.first_token_s is not None:
                mine["ttft"].append(1000 * stats.first_token_s)
            for key in ("rounds", "draft_tokens", "accepted_tokens", "generated_tokens", "resumes"):
                done[key] = getattr(stats, key)
            totals.update(done)
            mine["totals"].update(done)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(config.sessions)))
    wall = time.perf_counter() - start
    ms = sorted(1000 * r for r in rounds)
    return {
        "drafting": config.drafting,
        "sessions": config.sessions,
        "duration_s": config.duration_s,
        "wall_s": wall,
        "generations": totals["generations"],
        "rounds": totals["rounds"],
        "tokens": totals["generated_tokens"],
        "tokens_per_s": totals["generated_tokens"] / wall,
        "rounds_per_s": totals["rounds"] / wall,
        "acceptance_rate": totals["accepted_tokens"] / max(1, totals["draft_tokens"]),
        "p50_round_ms": percentile(ms, 0.5),
        "p99_round_ms": percentile(ms, 0.99),
        "errors": dict(errors),
        "mismatches": totals["mismatches"],
        "resumes": totals["resumes"],
        "by_kind": {kind: _kind_report(kind, k, config, wall) for kind, k in sorted(kinds.items())},
    }


def _kind_report(kind: str, k: dict, config: LoadConfig, wall: float) -> dict:
    """One kind's figures: its sessions, generations, tokens and their rate, acceptance, TTFT."""
    t = k["totals"]
    return {
        "sessions": sum(config.kind(w).value == kind for w in range(config.sessions)),
        "generations": t["generations"],
        "errors": t["errors"],
        "mismatches": t["mismatches"],
        "rounds": t["rounds"],
        "tokens": t["generated_tokens"],
        "tokens_per_s": t["generated_tokens"] / wall,
        "tokens_per_round": t["generated_tokens"] / t["rounds"] if t["rounds"] else 0.0,
        "acceptance_rate": t["accepted_tokens"] / t["draft_tokens"] if t["draft_tokens"] else None,
        "generation_tokens_per_s_p50": percentile(k["rates"], 0.5),
        "ttft_ms_p50": percentile(k["ttft"], 0.5),
        "ttft_ms_p99": percentile(k["ttft"], 0.99),
    }


def report_text(r: dict) -> str:
    latency = (
        f"round latency p50 {r['p50_round_ms']:.2f} ms, p99 {r['p99_round_ms']:.2f} ms"
        if r["rounds"]
        else "no rounds"
    )
    errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"
    return "\n".join(
        [
            f"{r['sessions']} sessions for {r['duration_s']:g} s (wall {r['wall_s']:.1f} s): "
            f"{r['generations']} generations, {r['rounds']} rounds, {r['tokens']} tokens",
            f"throughput {r['tokens_per_s']:.1f} tokens/s, {r['rounds_per_s']:.1f} rounds/s, "
            f"acceptance {r['acceptance_rate']:.2f}",
            latency,
            f"errors: {errors}; mismatches: {r['mismatches']}; resumes: {r['resumes']}",
            *(_kind_text(kind, k) for kind, k in r.get("by_kind", {}).items()),
        ]
    )


def _kind_text(kind: str, k: dict) -> str:
    acceptance = "" if k["acceptance_rate"] is None else f", acceptance {k['acceptance_rate']:.2f}"
    ttft = "" if k["ttft_ms_p50"] is None else f", TTFT p50 {k['ttft_ms_p50']:.0f} ms"
    return (
        f"  {kind}: {k['sessions']} sessions, {k['generations']} generations, {k['tokens']} tokens, "
        f"{k['tokens_per_s']:.1f} tokens/s, {k['tokens_per_round']:.2f} tokens/round{acceptance}{ttft}; "
        f"errors {k['errors']}, mismatches {k['mismatches']}"
    )


def _request(prompt: tuple[int, ...], config: LoadConfig, drafting: Drafting) -> GenerationRequest:
    return GenerationRequest(
        prompt,
        max_new_tokens=config.new_tokens,
        gamma=config.gamma,
        ignore_eos=True,
        pipeline=config.pipeline,
        drafting=drafting,
    )
