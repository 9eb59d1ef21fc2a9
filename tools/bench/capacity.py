"""Benchmark: one verifier replica's capacity: N concurrent sessions, thin or drafted by their edges.

One run, one replica (a `draftwire serve` child process), the same prompts in every arm:
  (a) thin sessions, drafting NONE: the verifier decodes them with the target alone;
  (b) thin sessions, drafting NGRAM: the verifier drafts by prompt lookup (draftwire/ngram.py);
  (c) edge sessions with llama.cpp drafts: 'live' (the real draft in this process) up to `live_max`
      sessions, 'replayed' at every N (the real draft's proposals, recorded once).
The verifier runs pinned to its own cores (`verifier_cpus`), this process and its drafts to others
(`edge_cpus`): the drafts never take the verifier's cores. One core cannot draft live for many sessions
at once, so the replayed rows stand for N devices that each draft on their own hardware: before the
waves, the real draft proposes (greedy) from every prefix of the target's reference output of each
prompt, and a replayed proposal is the one recorded for its prefix, after a sleep of the real draft's
measured time for that many tokens. Greedy, so every arm commits the target's reference output; a
proposal off that path (pipelined on a guess that failed) is answered stale whatever it holds.

Each cell is one wave: N sessions start together, each commits `new_tokens` (EOS ignored). Every figure
counts prefill: the wall time runs from the opens, the positions include the prompts', and the verifier
keeps no finished session's cache (--prefix-cache-mb 0), so no prompt is prefilled for free.

    python -m tools.bench.capacity [--sessions 1,4,16,32] [--new-tokens 64] [--out docs/runs/capacity]
        [--prompt-set chat|code] [--arms abc]

`--prompt-set code`: held-out code turns (write, complete, rewrite given code; draftwire_cli.models.prompts)
instead of the chat turns; `--arms ab`: the thin arms alone (no draft is recorded or run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from draftwire.contract import Drafting, SamplingParams
from draftwire.ngram import RULE as NGRAM_RULE
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.figures import percentile
from draftwire_cli.models.prompts import PROMPT_SETS, prompt_set
from edge_client.session import EdgeSession, GenerationRequest
from tools.bench import ngram_replay
from tools.rig import devices


@dataclass(frozen=True)
class CapacityConfig:
    target_dir: Path  # transformers target of the replica
    draft_gguf: Path  # the edges' llama.cpp draft
    prompts: tuple[tuple[int, ...], ...]  # session i of a wave opens with prompts[i % len(prompts)]
    sessions: tuple[int, ...] = (1, 4, 16, 32)  # N: concurrent sessions per wave
    new_tokens: int = 64  # tokens each session commits (EOS ignored)
    gamma: int = 4  # draft tokens per proposal of (c)
    pipeline: int = 2  # proposals (c) sends ahead of their verdicts
    live_max: int = 1  # (c) also runs with the live draft for N up to this
    repeats: int = 1  # waves per cell; the middle one by served tokens/s is reported (of two, the slower)
    verifier_cpus: tuple[int, ...] = (1,)  # the replica's cores (one torch thread each)
    edge_cpus: tuple[int, ...] = (0,)  # this process's: clients and drafts
    max_batch: int = 64  # the replica's most sessions per forward pass
    window_ms: float = 10.0  # the replica's batch window
    dtype: str = "auto"  # the target's (serve --dtype)
    invariant: bool = True  # bit-exact kernels (serve's default); False: --no-bit-exact
    gamma_cap: bool = True  # the replica's γ cap under load (serve's default); False: --no-gamma-cap
    arms: str = "abc"  # which arms run (see ARMS); without c no draft is recorded
    prompt_set: str = "chat"  # what `prompts` are (draftwire_cli.models.prompts.PROMPT_SETS), for the report


ARMS = {
    "a": "thin, target alone (NONE)",
    "b": "thin, server n-gram (NGRAM)",
    "c": "edge, llama.cpp draft",
}


class RecordedDrafter:
    """The real draft's greedy proposals along the target's output of one prompt, replayed: tokens in,
    tokens out, after the time the real draft took for that many tokens (and, the first time, for the
    prompt's evaluation)."""

    def __init__(self, script, prompt_length, table, vocabulary, timing: tuple[float, float], executor):
        """`script`: prompt plus the target's output; `table[p]`: the draft's proposal after script[:p]
        (for p from `prompt_length` on); `timing`: the draft's (seconds a token, seconds to evaluate
        this prompt)."""
        self.script, self.prompt_length, self.table = list(script), prompt_length, table
        self.vocabulary = vocabulary
        self.seconds_per_token, self.prefill_s = timing
        self.executor = executor  # sleeps off the event loop, each session as if on its own device

    def propose(
        self, sequence, gamma: int, params: SamplingParams, stop_token_ids=(), prompt_length=0
    ) -> list[int]:
        n = len(sequence)
        time.sleep(gamma * self.seconds_per_token + (self.prefill_s if n == self.prompt_length else 0.0))
        draft = self.table.get(n, [])[:gamma]
        if list(sequence) != self.script[:n] or len(draft) < gamma:
            # Off the target's path (this proposal will come back stale) or past the recording.
            draft = (draft + [0] * gamma)[:gamma]
        return draft


class _Metered(EdgeSession):
    """An EdgeSession that also counts what it sends (GenerationStats.wire_bytes counts both ways)."""

    upload_bytes = 0

    async def _write(self, call, message, stats) -> None:
        self.upload_bytes += message.ByteSize()
        await EdgeSession._write(call, message, stats)


async def _stats(channel) -> pb.ServerStats:
    return await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())


async def run_wave(address: str, config: CapacityConfig, arm: str, n: int, drafters=None) -> dict:
    """N sessions of one arm at once; `drafters[i]`: session i's (arm c). The row of figures, with the
    sessions' outputs."""
    drafting = {"a": Drafting.NONE, "b": Drafting.NGRAM, "c": Drafting.EDGE}[arm]
    async with grpc.aio.insecure_channel(address) as channel:
        before = await _stats(channel)

        async def one(i: int):
            session = _Metered(channel, drafters[i] if drafters else None)
            prompt = config.prompts[i % len(config.prompts)]
            thin = drafting is not Drafting.EDGE
            request = GenerationRequest(
                prompt,
                SamplingParams(),
                config.new_tokens,
                gamma=config.gamma,
                ignore_eos=True,
                pipeline=0 if thin else config.pipeline,
                drafting=drafting,
            )
            ids, stats = await session.run(request)
            return ids, stats, session.upload_bytes

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - start
        after = await _stats(channel)
    delta = {
        k: getattr(after, k) - getattr(before, k)
        for k in (
            "generated_tokens",
            "round_positions",
            "prefill_positions",
            "engine_batches",
            "engine_forwards",
            "engine_seconds",
        )
    }
    tokens = sum(len(ids) for ids, _, _ in results)
    up = sum(u for _, _, u in results)
    down = sum(s.wire_bytes for _, s, _ in results) - up
    rates = [len(ids) / s.wall_s for ids, s, _ in results]
    ttft = [1000 * s.first_token_s for _, s, _ in results if s.first_token_s is not None]
    rounds = sum(s.rounds for _, s, _ in results)
    drafted = sum(s.draft_tokens for _, s, _ in results)
    batches, engine_s = delta["engine_batches"], delta["engine_seconds"]
    return {
        "arm": arm,
        "sessions": n,
        "drafts": "" if arm != "c" else ("replayed" if drafters and _replayed(drafters[0]) else "live"),
        "tokens": tokens,
        "server_tokens": delta["generated_tokens"],
        "wall_s": wall,
        "served_tokens_per_s": tokens / wall,
        "session_tokens_per_s_p50": percentile(rates, 0.5),
        "session_tokens_per_s_p10": percentile(rates, 0.1),
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p90": percentile(ttft, 0.9),
        "rounds": rounds,
        "tokens_per_round": tokens / rounds if rounds else None,
        "draft_tokens_per_round": drafted / rounds if rounds else None,
        "acceptance": sum(s.accepted_tokens for _, s, _ in results) / drafted if drafted else None,
        "forward_passes_per_token": batches / tokens,  # the target's batched passes
        "session_forwards_per_token": delta["engine_forwards"] / tokens,  # sessions' rows in them
        "positions_per_token": (delta["round_positions"] + delta["prefill_positions"]) / tokens,
        "prefill_positions": delta["prefill_positions"],
        "mean_batch": delta["engine_forwards"] / batches if batches else 0.0,
        "ms_per_forward_pass": 1000 * engine_s / batches if batches else 0.0,
        "engine_busy": engine_s / wall,
        # The served rate if the engine never waited, at the forward costs and batches measured.
        "bound_tokens_per_s": tokens / engine_s if engine_s else None,
        "upload_bytes_per_token": up / tokens,
        "download_bytes_per_token": down / tokens,
        "upload_bytes_per_round": up / rounds if rounds else None,
        "gamma_cap_min": min((s.min_gamma_cap for _, s, _ in results if s.min_gamma_cap), default=None),
        "gamma_cap_end": after.gamma_cap,  # the replica's cap when the wave ended
        "outputs": [list(ids) for ids, _, _ in results],
    }


def _replayed(drafter) -> bool:
    return isinstance(drafter, RecordedDrafter)


def record_drafts(config: CapacityConfig, references, log=print):
    """For each prompt, the real draft's greedy proposal of gamma + 1 tokens (a pipelined proposal asks
    one more: its guess of the bonus) after every prefix of the target's output; the draft's mean
    seconds per drafted token (after a prompt's first proposal, each extends the last prefix by one
    token, as a round does by its few); and per prompt, the seconds its evaluation added to its first
    proposal. Runs on this process's cores, one llama.cpp thread."""
    from edge_client.drafter import DrafterConfig, LlamaDrafter

    drafter = LlamaDrafter(DrafterConfig(config.draft_gguf, n_ctx=_n_ctx(config), n_threads=1))
    tables, firsts, seconds, drafted = [], [], 0.0, 0
    for prompt, output in zip(config.prompts, references, strict=True):
        script, table = [*prompt, *output], {}
        for p in range(len(prompt), len(script)):
            start = time.perf_counter()
            table[p] = drafter.propose(script[:p], config.gamma + 1, SamplingParams())
            took = time.perf_counter() - start
            if p == len(prompt):
                firsts.append((took, len(table[p])))
            else:
                seconds, drafted = seconds + took, drafted + len(table[p])
        tables.append(table)
    per_token = seconds / max(1, drafted)
    prefills = [max(0.0, took - n * per_token) for took, n in firsts]
    log(
        f"recorded {drafted} draft tokens, {1000 * per_token:.2f} ms a token; "
        f"a prompt's evaluation {1000 * statistics.fmean(prefills):.0f} ms"
    )
    return drafter.vocabulary, tables, per_token, prefills


def _n_ctx(config: CapacityConfig) -> int:
    return max(map(len, config.prompts)) + config.new_tokens + 2 * config.gamma + 16


def _median_wave(waves: list[dict]) -> dict:
    ordered = sorted(waves, key=lambda w: w["served_tokens_per_s"])
    return {
        **ordered[(len(ordered) - 1) // 2],
        "served_tokens_per_s_each": [w["served_tokens_per_s"] for w in waves],
    }


async def run_all(config: CapacityConfig, log=print) -> dict:

    from edge_client.drafter import DrafterConfig, LlamaDrafter

    unknown = set(config.arms) - set(ARMS)
    if unknown or not config.arms:
        raise ValueError(f"arms {config.arms!r}: letters of {''.join(ARMS)}")
    flags = ["--dtype", config.dtype]
    flags += ["--max-batch", str(config.max_batch), "--batch-window-ms", str(config.window_ms)]
    flags += ["--max-gamma", str(config.gamma + 1), "--prefix-cache-mb", "0"]
    flags += [] if config.invariant else ["--no-bit-exact"]
    flags += [] if config.gamma_cap else ["--no-gamma-cap"]
    rows: list[dict] = []
    rig = {"edge_cpus": config.edge_cpus, "verifier_cpus": config.verifier_cpus}
    with devices.verifier(config.target_dir, *flags, **rig) as server:
        # The reference: the target alone, every prompt once (also the replica's warm-up; not counted).
        log(f"reference: {len(config.prompts)} prompts, the target alone")
        reference = await run_wave(server.address, config, "a", len(config.prompts))
        references = reference["outputs"]
        ngram = [
            ngram_replay.replay(p, out, config.gamma + 1)
            for p, out in zip(config.prompts, references, strict=True)
        ]
        drafting = "c" in config.arms
        if drafting:
            vocabulary, tables, per_token, prefills = record_drafts(config, references, log)
        else:
            vocabulary, tables, per_token, prefills = None, [], None, []
        replay_pool = ThreadPoolExecutor(max_workers=max(config.sessions), thread_name_prefix="replay")

        def live(n: int) -> list[LlamaDrafter]:
            """Fresh drafts for a wave: none keeps an earlier wave's prompt in its cache."""
            return [
                LlamaDrafter(DrafterConfig(config.draft_gguf, n_ctx=_n_ctx(config), n_threads=1))
                for _ in range(n)
            ]

        for n in config.sessions:
            replayed = [
                RecordedDrafter(
                    [*config.prompts[i % len(config.prompts)], *references[i % len(config.prompts)]],
                    len(config.prompts[i % len(config.prompts)]),
                    tables[i % len(config.prompts)],
                    vocabulary,
                    (per_token, prefills[i % len(config.prompts)]),
                    replay_pool,
                )
                for i in range(n)
                if drafting
            ]
            # Each cell: its arm and what makes its drafters for a wave.
            cells = [("a", lambda: None), ("b", lambda: None), ("c", lambda r=replayed: r)]
            cells += [("c", lambda n=n: live(n))] if n <= config.live_max else []
            cells = [cell for cell in cells if cell[0] in config.arms]
            # The arms take turns, repeat by repeat, so that drift on a shared machine touches them alike.
            by_cell: list[list[dict]] = [[] for _ in cells]
            for _ in range(config.repeats):
                for (arm, drafters), waves in zip(cells, by_cell, strict=True):
                    waves.append(await run_wave(server.address, config, arm, n, drafters()))
            for waves in by_cell:
                row = _median_wave(waves)
                expected = [references[i % len(config.prompts)] for i in range(n)]
                row["exact"] = row.pop("outputs") == expected
                for w in waves:
                    row["exact"] &= w["outputs"] == expected
                if row["arm"] == "b":  # what prompt lookup does on these outputs, replayed offline
                    row["ngram_replay"] = ngram_replay.totals([ngram[i % len(ngram)] for i in range(n)])
                log(json.dumps(row))  # a run cut short keeps what it measured
                rows.append(row)
        replay_pool.shutdown()
    return {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "prompts"
        },
        "prompts": len(config.prompts),
        "prompt_tokens_mean": statistics.fmean(map(len, config.prompts)),
        "draft_ms_per_token": None if per_token is None else 1000 * per_token,
        "draft_prompt_ms_mean": 1000 * statistics.fmean(prefills) if prefills else None,
        "rows": rows,
        "ratios": ratios(rows),
        # Per prompt: the target's greedy output, and arm (b)'s prompt lookup on it, replayed offline.
        "references": references,
        "ngram_by_prompt": ngram,
        "ngram_rule": asdict(NGRAM_RULE),  # what the verifier drafted by (--ngram-from replays it)
    }


def ratios(rows: list[dict]) -> dict:
    """Served tokens/s of (b) and (c) over (a)'s at each N."""
    by = {(r["arm"], r["drafts"], r["sessions"]): r["served_tokens_per_s"] for r in rows}
    out = {}
    for (arm, drafts, n), rate in by.items():
        if arm != "a" and ("a", "", n) in by:
            out[f"{arm}{'/' + drafts if drafts else ''}/N{n}"] = rate / by[("a", "", n)]
    return out


def markdown(report: dict) -> str:
    c = report["config"]
    drafts = (
        f"(c) γ {c['gamma']}, pipeline {c['pipeline']}, draft {report['draft_ms_per_token']:.1f} ms a "
        f"token, {report['draft_prompt_ms_mean']:.0f} ms a prompt"
        if report["draft_ms_per_token"] is not None
        else "no edge drafts"
    )
    lines = [
        f"{report['prompts']} {c.get('prompt_set', 'chat')} prompts (mean "
        f"{report['prompt_tokens_mean']:.0f} tokens), {c['new_tokens']} new tokens a session, greedy; "
        f"arms {c.get('arms', 'abc')}; {drafts}; verifier on cores {c['verifier_cpus']}, "
        f"edges on {c['edge_cpus']}; prefill counted everywhere",
        "",
        "| N | arm | drafts | served tok/s | × (a) | bound tok/s | session tok/s p50 | p10 | TTFT ms p50 "
        "| forward passes/tok | session forwards/tok | positions/tok | mean batch | ms/forward | ms/position "
        "| engine busy | tok/round | accept | up B/tok | down B/tok | up B/round | exact |",
        "|" + "---|" * 22,
    ]

    def f(v, fmt=".2f"):
        return "" if v is None else format(v, fmt)

    ratio = report["ratios"]
    for r in report["rows"]:
        key = f"{r['arm']}{'/' + r['drafts'] if r['drafts'] else ''}/N{r['sessions']}"
        cells = [
            str(r["sessions"]),
            f"({r['arm']}) {ARMS[r['arm']]}",
            r["drafts"],
            f"{r['served_tokens_per_s']:.1f}",
            f(ratio.get(key)),
            f(r["bound_tokens_per_s"], ".1f"),
            f(r["session_tokens_per_s_p50"], ".1f"),
            f(r["session_tokens_per_s_p10"], ".1f"),
            f(r["ttft_ms_p50"], ".0f"),
            f(r["forward_passes_per_token"], ".3f"),
            f(r["session_forwards_per_token"], ".3f"),
            f(r["positions_per_token"]),
            f(r["mean_batch"], ".1f"),
            f(r["ms_per_forward_pass"], ".1f"),
            f(_ms_per_position(r), ".1f"),
            f"{r['engine_busy']:.0%}",
            f(r.get("tokens_per_round")),
            f(r["acceptance"]),
            f(r["upload_bytes_per_token"], ".1f"),
            f(r["download_bytes_per_token"], ".1f"),
            f(r["upload_bytes_per_round"], ".0f"),
            str(r["exact"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "bound: generated tokens over the engine's measured forward time in that wave, the served rate "
        "if the target never waited (same batches, same ms per forward pass). ms/position: a forward "
        "pass's time over the positions (prefill and rounds) it computed.",
    ]
    return "\n".join(lines)


def _ms_per_position(r: dict) -> float | None:
    """A forward pass's time over the positions it computed, prefill included."""
    if not r["positions_per_token"]:
        return None
    return r["ms_per_forward_pass"] * r["forward_passes_per_token"] / r["positions_per_token"]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = [("a", ""), ("b", ""), ("c", "replayed"), ("c", "live")]
    for (arm, drafts), color in zip(lines, ("C0", "C1", "C2", "C3"), strict=True):
        rows = [r for r in report["rows"] if r["arm"] == arm and r["drafts"] == drafts]
        if not rows:
            continue
        label = f"({arm}) {ARMS[arm]}" + (f", {drafts}" if drafts else "")
        n = [r["sessions"] for r in rows]
        ax.plot(n, [r["served_tokens_per_s"] for r in rows], "o-", color=color, label=label)
        ax.plot(n, [r["bound_tokens_per_s"] for r in rows], ":", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["config"]["sessions"], [str(n) for n in report["config"]["sessions"]])
    ax.set_xlabel("concurrent sessions N")
    ax.set_ylabel("served tokens/s of the replica")
    ax.set_title("one replica's capacity (dotted: bound from the measured forward costs)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(report: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out_dir / "capacity.png")
    table = markdown(report)
    (out_dir / "capacity.md").write_text(table + "\n")
    return table


def parser() -> argparse.ArgumentParser:
    from draftwire_cli.models import smollm2

    home = smollm2.default_dir()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=home / "target", help="transformers target directory")
    ap.add_argument("--draft", type=Path, default=home / "draft-q4_1.gguf", help="the edges' GGUF draft")
    ap.add_argument("--prompt-set", choices=PROMPT_SETS, default="chat", help="held-out chat or code turns")
    ap.add_argument("--prompts", type=int, default=None, help="how many of the set (default: all)")
    ap.add_argument("--arms", default="abc", help="which arms run: letters of abc (default: all)")
    ap.add_argument("--sessions", type=_ints, default=(1, 4, 16, 32), help="N, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--live-max", type=int, default=1, help="(c) also runs the live draft up to this N")
    ap.add_argument("--repeats", type=int, default=1, help="waves per cell (the median is reported)")
    ap.add_argument("--verifier-cpus", type=_ints, default=(1,))
    ap.add_argument("--edge-cpus", type=_ints, default=(0,))
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-bit-exact", action="store_true")
    ap.add_argument("--no-gamma-cap", action="store_true", help="the replica never lowers γ under load")
    ap.add_argument("--out", type=Path, default=Path("runs/capacity"))
    ap.add_argument(
        "--ngram-from",
        type=Path,
        metavar="JSON",
        help="run nothing: replay arm (b)'s prompt lookup on that report's outputs, by prompt kind, with the "
        "rule the report was run with and the verifier's current one",
    )
    ap.add_argument(
        "--ngram-rule",
        type=ngram_replay.rule_arg,
        action="append",
        metavar="MIN,MAX,LAG",
        help="with --ngram-from: replay this rule instead (repeatable; LAG '-': gamma tokens whatever the "
        "match), e.g. 1,3,- (any 1-gram, as before) or 4,10,2 (the default)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.ngram_from:
        print(
            ngram_replay.markdown(
                ngram_replay.breakdown_of_report(args.ngram_from, args.target, args.ngram_rule)
            )
        )
        return 0
    config = config_from_args(args)
    report = asyncio.run(run_all(config, log=lambda m: print(m, flush=True)))
    print(write_outputs(report, args.out))
    return 0 if all(r["exact"] for r in report["rows"]) else 1


def config_from_args(args: argparse.Namespace) -> CapacityConfig:
    """The run the command line asks for."""
    return CapacityConfig(
        target_dir=args.target,
        draft_gguf=args.draft,
        prompts=prompt_set(args.prompt_set, args.target, args.prompts),
        prompt_set=args.prompt_set,
        arms=args.arms,
        sessions=args.sessions,
        new_tokens=args.new_tokens,
        gamma=args.gamma,
        pipeline=args.pipeline,
        live_max=args.live_max,
        repeats=args.repeats,
        verifier_cpus=args.verifier_cpus,
        edge_cpus=args.edge_cpus,
        max_batch=args.max_batch,
        dtype=args.dtype,
        invariant=not args.no_bit_exact,
        gamma_cap=not args.no_gamma_cap,
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


if __name__ == "__main__":
    raise SystemExit(main())
