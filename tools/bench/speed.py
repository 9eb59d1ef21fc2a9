"""`draftwire bench`: draftwire against the target alone and transformers' own speculation, one run.
Run from a checkout: `draftwire bench ...` runs `python -m tools.bench.speed ...`.

Arms, on the same prompts and models: (a) the target alone through our engine, one token per forward;
(b) transformers' `generate` with assisted generation (the draft's transformers form) and with
prompt-lookup decoding, greedy; (c) draftwire over loopback gRPC (a `draftwire serve` child process,
the llama.cpp draft in this process) for a sweep of gamma, greedy and seeded sampling; (d) the same
through a delaying proxy at several RTTs. (c) and (d) also run pipelined (proposals sent ahead of their
verdicts) at each depth asked for. The two-device rig (`edge_cpus`, `verifier_cpus`) pins this process,
the edge, to some cores and the verifier and the arms (a) and (b) to others: a device and a server do
not share cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import grpc

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.cliargs import add_target_numerics, id_list, rig
from draftwire_cli.figures import percentile
from draftwire_cli.flags import UserError, count, gamma, positive, temperature
from edge_client.adaptive import path_rounds
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats
from edge_client.speed_model import Costs, Estimates, tokens_per_second
from tools.bench.arms import BenchConfig, Row, params_for, route
from tools.rig import devices


def expected_tokens_per_round(acceptance: float, gamma: int) -> float:
    """Tokens per round when each draft token is accepted independently with probability a."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def zero_overhead_bound(row: Row) -> float | None:
    """Tokens/s if a round cost only its drafting and its verification, as measured: no wire, no Python
    around them. A draft begun with nothing live in flight (a restart: every draft unpipelined, and
    pipelined the first and each after a miss) and its verification run one after the other; a draft
    made while an earlier proposal is verified overlaps it, and the slower of the two sets the pace:

        round = (1 - r) · max(d, v) + r · (d + v)

    with r the restarts per verified round (at most 1), d the drafting per drafter call and v the
    verification per round. Unpipelined r = 1, and a round is d + v."""
    if not row.tokens_per_round or row.draft_ms_per_round is None or row.verify_ms_per_round is None:
        return None
    verify = row.verify_ms_per_round
    if row.pipeline == 0:
        restarts, draft = 1.0, row.draft_ms_per_round
    elif row.restarts_per_round is None or not row.drafts_per_round:
        return None  # a row measured before drafts and restarts were counted
    else:
        restarts = min(1.0, row.restarts_per_round)
        draft = row.draft_ms_per_round / row.drafts_per_round
    round_ms = (1 - restarts) * max(draft, verify) + restarts * (draft + verify)
    return 1000 * row.tokens_per_round / round_ms if round_ms > 0 else None


def add_bound(row: Row) -> None:
    """Sets the row's zero-overhead bound and the share of it the row reached."""
    row.bound_tokens_per_s = zero_overhead_bound(row)
    if row.bound_tokens_per_s:
        row.share_of_bound = row.tokens_per_s / row.bound_tokens_per_s


async def run_draftwire(
    config: BenchConfig,
    drafter: LlamaDrafter,
    address: str,
    upstream: str,
    mode: str,
    gamma: int | None,
    rtt_ms: float,
    pipeline: int | None = 0,
) -> Row:
    """A row: every prompt of `config` through one edge session. `gamma` or `pipeline` None: chosen
    online (edge_client.adaptive), the row's figure 0; one tuner learns across the row's prompts, as in a
    chat or the edge app."""
    async with RowRun(config, drafter, address, upstream, mode, gamma, rtt_ms, pipeline) as run:
        for i in range(len(config.prompts)):
            await run.prompt(i)
    return run.row()


class RowRun:
    """One setting's edge session, run a prompt at a time, so that rows can take turns prompt by prompt
    (a burst of someone else's load then falls on every row alike); `row()` sums what its prompts did.
    The verifier's counters are read around each prompt, so other rows' work between them is not
    counted.

    `channel`: the channel to `address` to run on (None: one of its own). Rows that share one also share
    the verifier's kept caches, which it keeps per connection for anonymous callers."""

    def __init__(self, config, drafter, address, upstream, mode, gamma, rtt_ms, pipeline=0, channel=None):
        self.config, self.drafter, self.address, self.upstream = config, drafter, address, upstream
        self._channel = channel
        self.mode, self.gamma, self.pipeline = mode, gamma, pipeline
        arm = "d" if rtt_ms else "c"
        label = f"draftwire, {rtt_ms:g} ms RTT" if rtt_ms else "draftwire, loopback"
        if pipeline:
            label += f", pipelined {pipeline}"
        self._row = Row(arm, label, mode, gamma or 0, rtt_ms, pipeline or 0)
        self._stats: list[GenerationStats] = []
        self._positions = 0
        self._engine_s = 0.0
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> RowRun:
        stats_channel = await self._stack.enter_async_context(grpc.aio.insecure_channel(self.upstream))
        self._server = pb_grpc.VerifierStub(stats_channel)
        channel = self._channel or await self._stack.enter_async_context(
            grpc.aio.insecure_channel(self.address)
        )
        self.session = EdgeSession(channel, self.drafter)
        await self.session.model_info()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()

    async def prompt(self, i: int) -> None:
        """Runs prompt `i` of the config (with its sampling) through the session."""
        request = GenerationRequest(
            self.config.prompts[i],
            params_for(self.mode, self.config, i),
            self.config.max_new_tokens,
            self.gamma,
            ignore_eos=True,
            pipeline=self.pipeline,
        )
        before = await self._server.GetStats(pb.StatsRequest())
        ids, stats = await self.session.run(request)
        after = await self._server.GetStats(pb.StatsRequest())
        self._row.outputs.append(ids)
        self._stats.append(stats)
        self._positions += after.round_positions - before.round_positions
        self._engine_s += after.engine_seconds - before.engine_seconds

    def row(self) -> Row:
        row, all_stats, gamma, tuner = self._row, self._stats, self.gamma, self.session.tuner
        setting = (gamma, self.pipeline)
        if gamma is None or self.pipeline is None:
            setting = tuner.choice
            row.label += f", adaptive (ended at γ {setting[0]}, depth {setting[1]}; {tuner.moves} moves)"
            row.tuner_path = path_rounds(tuner.path, tuner.rounds)
        # The tuner learns from fixed rows too: its model's figure beside the measured one tests the model.
        row.model_tokens_per_s = tokens_per_second(tuner.estimates(), *setting)
        rounds = sum(s.rounds for s in all_stats)
        row.tokens = sum(map(len, row.outputs))
        row.wall_s = sum(s.wall_s for s in all_stats)
        drafted = sum(s.draft_tokens for s in all_stats)
        row.acceptance = sum(s.accepted_tokens for s in all_stats) / drafted if drafted else None
        row.tokens_per_round = row.tokens / rounds
        row.expected_tokens_per_round = expected_tokens_per_round(row.acceptance, gamma) if gamma else None
        row.target_positions_per_token = self._positions / row.tokens
        row.bytes_per_token = sum(s.wire_bytes for s in all_stats) / row.tokens
        round_ms = [1000 * t for s in all_stats for t in s.round_s]
        row.round_ms_p50, row.round_ms_p99 = percentile(round_ms, 0.5), percentile(round_ms, 0.99)
        row.draft_ms_per_round = 1000 * sum(s.draft_s for s in all_stats) / rounds
        row.verify_ms_per_round = 1000 * self._engine_s / rounds
        row.wire_ms_per_round = statistics.fmean(round_ms) - row.verify_ms_per_round
        row.stale_per_round = sum(s.stale_rounds for s in all_stats) / rounds
        row.drafts_per_round = sum(s.drafts for s in all_stats) / rounds
        row.restarts_per_round = sum(s.restarts for s in all_stats) / rounds
        row.plain_steps = sum(s.plain_steps for s in all_stats)
        row.server_tokens = sum(s.server_tokens for s in all_stats)
        row.speculation_offs, row.probes, row.speculation_reason = tuner.offs, tuner.probes, tuner.reason
        row.tuner_rtt_ms = 1000 * tuner.rtt_s if tuner.rtt_s is not None else None
        row.tuner = tuner_view(tuner)
        row.reused_positions = sum(s.reused_positions for s in all_stats)
        return row


def tuner_view(tuner) -> dict:
    """What a tuner holds, for a bench's JSON: the model's inputs as the tuner sees them, so that a row
    whose choice looks wrong can be read against its measured figures
    (docs/runs/benchmarks-history.md, haiku)."""
    est = tuner.estimates()

    def sizes(line) -> dict:
        return {
            str(n): {"ms": round(1000 * s, 2), "count": line.counts[n]} for n, s in sorted(line.means.items())
        }

    def ms(*seconds: float) -> list[float]:
        return [round(1000 * s, 2) for s in seconds]

    def view(costs, draft, verify) -> dict:
        return {
            "verify_by_positions": sizes(verify),  # the figures, then what the model uses at each size
            "verify_estimate_ms": {str(n): ms(s)[0] for n, s in sorted(costs.verify_measured.items())},
            "verify_line_ms": ms(costs.verify_fixed_s, costs.verify_position_s),
            "draft_by_tokens": sizes(draft),
            "draft_line_ms": ms(costs.draft_fixed_s, costs.draft_token_s),
        }

    # "in turn": drafting and verifying one after the other (depth 0); "ahead": side by side (pipelined).
    # Where one was never measured, its estimates are the other's (Tuner.estimates).
    return {
        "acceptance": [round(a, 3) for a in est.acceptance],
        "in_turn": view(est, tuner.draft, tuner.verify),
        "ahead": view(est.costs(ahead=True), tuner.draft_ahead, tuner.verify_ahead),
    }


def model_at_own_acceptance(row: dict) -> float | None:
    """The tuner's model for a row's (last) setting from a bench's JSON row: the costs its tuner ended
    with (tuner_view), but the row's own acceptance over all its rounds, as the same rate at every
    position, in place of the tuner's, which follows the last prompt. The tuner's check (the row's
    model_tokens_per_s) then reads the model against the row, not the last prompt against the row: a
    chat point's last prompt, its easiest, put every row of it 0.79-0.98 there
    (docs/runs/benchmarks-history.md).
    None where the row has no tuner, no acceptance or no γ."""
    view, acceptance = row.get("tuner"), row.get("acceptance")
    gamma, depth = row["gamma"], row["pipeline"]
    if depth < 0:  # adaptive: where its path ended
        gamma, depth = (row.get("tuner_path") or [[0, 0, 0]])[-1][:2]
    if not view or not acceptance or not gamma:
        return None

    def costs(side: dict) -> dict:
        return dict(
            draft_fixed_s=side["draft_line_ms"][0] / 1000,
            draft_token_s=side["draft_line_ms"][1] / 1000,
            verify_fixed_s=side["verify_line_ms"][0] / 1000,
            verify_position_s=side["verify_line_ms"][1] / 1000,
            verify_measured={int(n): ms / 1000 for n, ms in side["verify_estimate_ms"].items()},
        )

    alpha = rate_of_acceptance(acceptance, gamma)
    est = Estimates(
        **costs(view["in_turn"]),
        acceptance=(alpha,) * len(view["acceptance"]),
        rtt_s=(row.get("tuner_rtt_ms") or 0.0) / 1000,
        ahead=Costs(**costs(view["ahead"])),
    )
    return tokens_per_second(est, gamma, depth)


def rate_of_acceptance(acceptance: float, gamma: int) -> float:
    """The per-position rate α that accepts `acceptance` of γ draft tokens on average when each is
    accepted with probability α after the ones before it: Σ_{k=1..γ} α^k / γ = acceptance."""
    low, high = 0.0, 1.0
    for _ in range(50):
        alpha = (low + high) / 2
        if sum(alpha**k for k in range(1, gamma + 1)) / gamma < acceptance:
            low = alpha
        else:
            high = alpha
    return (low + high) / 2


async def run_all(config: BenchConfig, log=print) -> dict:
    from tools.bench import target_arms

    rows: list[Row] = target_arms.in_child(config, log)
    reference = {r.mode: r for r in rows if r.arm == "a"}
    modes = tuple(reference)
    flags = ["--max-gamma", str(max(config.gammas)), "--dtype", config.dtype]
    flags += [] if config.invariant else ["--no-bit-exact"]
    server = devices.verifier(config.target_dir, *flags, **config.devices)
    drafter = LlamaDrafter(DrafterConfig(config.draft_gguf, n_threads=config.draft_threads))
    with server:
        host, port = server.address.rsplit(":", 1)
        for mode in modes:
            for gamma in config.gammas:
                for depth in config.pipelines:
                    log(f"(c) draftwire loopback, {mode}, gamma {gamma}, pipelined {depth}")
                    rows.append(
                        await run_draftwire(
                            config, drafter, server.address, server.address, mode, gamma, 0, depth
                        )
                    )
            gamma = config.delay_gamma
            for rtt in config.rtts_ms:
                async with route(host, int(port), rtt) as address:
                    for depth in config.pipelines:
                        log(f"(d) draftwire at {rtt:g} ms RTT, {mode}, gamma {gamma}, pipelined {depth}")
                        rows.append(
                            await run_draftwire(
                                config, drafter, address, server.address, mode, gamma, rtt, depth
                            )
                        )
    for row in rows:
        row.speedup = row.tokens_per_s / reference[row.mode].tokens_per_s
        add_bound(row)
    # draftwire's arms must equal the target alone; transformers' arms (b) run its plain kernels, which
    # agree only up to numerics (bit for bit in float32 on most prompts, not in bfloat16), so they are
    # reported, not required.
    same = {
        f"{r.arm}/{r.mode}/g{r.gamma}/rtt{r.rtt_ms:g}/p{r.pipeline}": r.outputs == reference[r.mode].outputs
        for r in rows
    }
    exact = {k: v for k, v in same.items() if k[0] in "acd"}
    return {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "prompts"
        },
        "prompts": len(config.prompts),
        "rows": [
            {**{k: v for k, v in asdict(r).items() if k != "outputs"}, "tokens_per_s": r.tokens_per_s}
            for r in rows
        ],
        "exact": exact,
        "transformers_equal_to_a": {k: v for k, v in same.items() if k[0] == "b"},
    }


def markdown(report: dict) -> str:
    head = (
        "| arm | mode | γ | RTT ms | pipe | tok/s | × (a) | bound tok/s | of bound | accept | tok/round "
        "| theory | target pos/tok | B/tok | round p50 ms | p99 ms | draft ms | verify ms | wire ms "
        "| stale/round |"
    )
    lines = [head, "|" + "---|" * 20]

    def f(v, fmt=".2f"):
        return "" if v is None else format(v, fmt)

    for r in report["rows"]:
        cells = [
            f"({r['arm']}) {r['label']}",
            r["mode"],
            str(r["gamma"] or ""),
            f(r["rtt_ms"] or None, "g"),
            str(r["pipeline"] or ""),
            f"{r['tokens_per_s']:.1f}",
            f(r["speedup"]),
            f(r["bound_tokens_per_s"], ".1f"),
            f(r["share_of_bound"]),
            f(r["acceptance"]),
            f(r["tokens_per_round"]),
            f(r["expected_tokens_per_round"]),
            f(r["target_positions_per_token"]),
            f(r["bytes_per_token"], ".0f"),
            *(f(r[k], ".1f") for k in ("round_ms_p50", "round_ms_p99", "draft_ms_per_round")),
            *(f(r[k], ".1f") for k in ("verify_ms_per_round", "wire_ms_per_round")),
            f(r["stale_per_round"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    bad = [k for k, ok in report["exact"].items() if not ok]
    lines.append("")
    lines.append("every arm's output equals (a)'s" if not bad else f"outputs differing from (a): {bad}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("greedy", "o-"), ("sampled", "s--")):
        for depth in report["config"]["pipelines"]:
            loop = [r for r in rows if r["arm"] == "c" and r["mode"] == mode and r["pipeline"] == depth]
            left.plot(
                [r["gamma"] for r in loop],
                [r["speedup"] for r in loop],
                style,
                label=f"draftwire loopback, {mode}" + (f", pipelined {depth}" if depth else ""),
                alpha=1 - 0.3 * bool(depth),
            )
        for depth in report["config"]["pipelines"]:
            delayed = [
                r
                for r in rows
                if r["arm"] in "cd"
                and r["mode"] == mode
                and r["gamma"] == report["config"]["delay_gamma"]
                and r["pipeline"] == depth
            ]
            label = f"{mode}, pipelined {depth}" if depth else mode
            right.plot(
                [r["rtt_ms"] for r in delayed],
                [r["speedup"] for r in delayed],
                style,
                label=label,
                alpha=1 - 0.3 * bool(depth),
            )
    for r in rows:
        if r["arm"] == "b":
            left.axhline(r["speedup"], color="grey", linestyle=":", label="transformers assisted (greedy)")
    for ax in (left, right):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("tokens/s over the target alone")
        ax.legend()
        ax.grid(alpha=0.3)
    left.set_xlabel("gamma (draft tokens per round)")
    right.set_xlabel(f"round-trip time, ms (gamma {report['config']['delay_gamma']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(report: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out_dir / "bench.png")
    table = markdown(report)
    (out_dir / "bench.md").write_text(table + "\n")
    return table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, required=True, help="transformers target directory")
    p.add_argument("--draft", type=Path, required=True, help="GGUF draft for the edge")
    p.add_argument("--draft-hf", type=Path, help="the draft's transformers form, for assisted generation")
    p.add_argument("--prompts", type=positive, default=20, help="held-out prompts")
    p.add_argument("--prompt-tokens", type=positive, default=48, help="length of the code prompts")
    p.add_argument("--chat", action="store_true", help="held-out chat turns instead of code (a chat target)")
    p.add_argument("--max-new-tokens", type=positive, default=64, help="tokens each run generates")
    p.add_argument(
        "--gammas", type=id_list, default=(1, 2, 4, 6, 8), help="the fixed γ of the draftwire runs"
    )
    p.add_argument("--rtts", type=id_list, default=(10, 30, 80), help="round-trip times in ms")
    p.add_argument("--delay-gamma", type=gamma, default=4, help="gamma of the delayed runs")
    p.add_argument(
        "--pipelines", type=id_list, default=(0, 2), help="pipeline depths of every draftwire run (0: none)"
    )
    p.add_argument("--draft-threads", type=positive, default=1, help="llama.cpp threads of the draft")
    p.add_argument("--verifier-threads", type=count, default=0, help="torch threads of the verifier (0: all)")
    p.add_argument(
        "--two-device",
        metavar="EDGE_CPUS:VERIFIER_CPUS",
        type=rig,
        default=((), ()),
        help="pin the edge and the verifier (and the target-alone arms) to separate cores, e.g. 0:1",
    )
    p.add_argument("--temperature", type=temperature, default=0.7, help="of the seeded sampled runs")
    add_target_numerics(p)
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="bench.json, bench.md, bench.png")


def main(argv: list[str] | None = None) -> int:
    from draftwire_cli.main import check_inputs, fail

    p = argparse.ArgumentParser(prog="draftwire bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(command="bench")
    args = p.parse_args(argv)
    try:
        check_inputs(args)  # a missing model said in one line, as every command says it
    except UserError as e:
        return fail(str(e), e.status)
    config = BenchConfig.from_args(
        args, delay_gamma=args.delay_gamma, pipelines=args.pipelines, verifier_threads=args.verifier_threads
    )
    report = asyncio.run(run_all(config, log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(write_outputs(report, args.out))
    return 0 if all(report["exact"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
