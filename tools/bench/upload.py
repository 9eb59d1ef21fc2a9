"""Upload per round: what an edge sends the verifier for each proposal, measured on a real pair and bounded
by the contract (issue 14: "≤ 1 KB upload per round at γ = 8").

Measured: edge sessions with the live llama.cpp draft at γ = 8 against a `draftwire serve` child process,
greedy and seeded sampling, without and with pipelining (a pipelined proposal also carries its assumed
token). Every EdgeMessage the edge writes is counted as gRPC frames it: its serialized bytes plus gRPC's
5-byte length prefix (a compressed flag and a 4-byte length; no compression is configured). Beside that,
a counting TCP proxy in front of the verifier gives every byte the edge's connection sent for the
session (HTTP/2 frame headers, the stream's HEADERS, WINDOW_UPDATE and PING frames included; no TLS).

Bounded: `worst_case` raises the fields of a proposal message the edge built to the largest values the
contract lets them take (round and start position 2^64 - 1, every id 2^32 - 1, and for the contract as
the verifier checks it, max_gamma + 1 assumed ids) and sizes it the same way.

    python -m tools.bench.upload [--prompt-set chat|code] [--prompts 8] [--gamma 8] [--out runs/upload]

writes upload-SET.md (the table) and upload-SET.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from draftwire.contract import SamplingParams
from draftwire.v1 import draftwire_pb2 as pb
from edge_client.session import EdgeSession, GenerationRequest

GRPC_PREFIX = 5  # gRPC's Length-Prefixed-Message: 1-byte compressed flag, 4-byte message length
UINT64_MAX = (1 << 64) - 1
UINT32_MAX = (1 << 32) - 1
BUDGET = 1024  # bytes a proposal frame may take at γ = 8 (issue 14)


def frame_bytes(message: pb.EdgeMessage) -> int:
    """The bytes gRPC puts on the stream for `message` (before HTTP/2's own 9-byte frame header)."""
    return len(message.SerializeToString()) + GRPC_PREFIX


def worst_case(message: pb.EdgeMessage, assumed: int | None = None) -> pb.EdgeMessage:
    """`message` (a proposal) with every number at the contract's largest: round and start position at
    2^64 - 1, each draft and assumed id at 2^32 - 1, every draft token named forced; with `assumed`, that
    many assumed ids (the contract allows max_gamma + 1). Fields are raised, none dropped: a field the edge
    sets stays set."""
    worst = pb.EdgeMessage()
    worst.CopyFrom(message)
    p = worst.proposal
    p.round = p.start_position = UINT64_MAX
    p.draft_token_ids[:] = [UINT32_MAX] * len(p.draft_token_ids)
    p.assumed_token_ids[:] = [UINT32_MAX] * (len(p.assumed_token_ids) if assumed is None else assumed)
    p.forced_indexes[:] = range(len(p.draft_token_ids))
    return worst


@dataclass
class Written:
    """What one generation's edge wrote: the frame bytes of each message, by kind."""

    open: list[int] = field(default_factory=list)
    proposals: list[int] = field(default_factory=list)
    assumed: list[int] = field(default_factory=list)  # assumed ids per proposal
    drafts: list[int] = field(default_factory=list)  # draft ids per proposal
    largest: pb.EdgeMessage | None = None  # the largest proposal message


class Counting(EdgeSession):
    """An EdgeSession that records every message it writes, as gRPC frames it."""

    written: Written

    async def _write(self, call, message, stats) -> None:
        size = frame_bytes(message)
        if message.WhichOneof("kind") == "proposal":
            w = self.written
            w.proposals.append(size)
            w.assumed.append(len(message.proposal.assumed_token_ids))
            w.drafts.append(len(message.proposal.draft_token_ids))
            if w.largest is None or size > frame_bytes(w.largest):
                w.largest = pb.EdgeMessage()
                w.largest.CopyFrom(message)
        else:
            self.written.open.append(size)
        await EdgeSession._write(call, message, stats)


async def measure(prompts, drafter, arm: dict, new_tokens: int, gamma: int, proxy) -> dict:
    """Every prompt once as an edge session of `arm` (sampling, pipeline) through the counting proxy."""
    from draftwire import wire

    rows = []
    async with wire.insecure_channel(proxy.address) as channel:
        session = Counting(channel, drafter)
        await session.model_info()
        for i, prompt in enumerate(prompts):
            session.written = Written()
            sampling = SamplingParams(**arm["sampling"], **({"seed": 1000 + i} if arm["seeded"] else {}))
            request = GenerationRequest(
                tuple(prompt), sampling, new_tokens, gamma=gamma, ignore_eos=True, pipeline=arm["pipeline"]
            )
            before = proxy.bytes_up
            ids, stats = await session.run(request)
            tcp = proxy.bytes_up - before
            w = session.written
            rows.append(
                {
                    "tokens": len(ids),
                    "rounds": stats.rounds,
                    "stale": stats.stale_rounds,
                    "proposals": len(w.proposals),
                    "open_bytes": sum(w.open),
                    "proposal_bytes": sum(w.proposals),
                    "proposal_max": max(w.proposals),
                    "gamma_max": max(w.drafts),
                    "assumed_max": max(w.assumed),
                    "tcp_bytes": tcp,
                    "acceptance": stats.acceptance_rate,
                    "largest": w.largest,
                }
            )
    rounds = sum(r["rounds"] for r in rows)
    proposals = sum(r["proposals"] for r in rows)
    largest = max((r["largest"] for r in rows), key=frame_bytes)
    return {
        "arm": arm["name"],
        "sessions": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "rounds": rounds,
        "proposals": proposals,
        "stale": sum(r["stale"] for r in rows),
        "acceptance": statistics.fmean(r["acceptance"] for r in rows),
        "gamma_max": max(r["gamma_max"] for r in rows),
        "assumed_max": max(r["assumed_max"] for r in rows),
        "proposal_frame_max": max(r["proposal_max"] for r in rows),
        "proposal_frame_mean": sum(r["proposal_bytes"] for r in rows) / proposals,
        # Per verified round: every proposal frame (stale ones too), and with the open spread over them.
        "proposal_bytes_per_round": sum(r["proposal_bytes"] for r in rows) / rounds,
        "grpc_bytes_per_round": sum(r["proposal_bytes"] + r["open_bytes"] for r in rows) / rounds,
        "tcp_bytes_per_round": sum(r["tcp_bytes"] for r in rows) / rounds,
        "open_frame_mean": statistics.fmean(r["open_bytes"] for r in rows),
        "largest_frame": frame_bytes(largest),
        "largest_worst_ids_numbers": frame_bytes(worst_case(largest)),
        "largest_hex": largest.SerializeToString().hex(),
    }


ARMS = (
    {"name": "greedy, no pipeline", "sampling": {}, "seeded": False, "pipeline": 0},
    {"name": "greedy, pipeline 2", "sampling": {}, "seeded": False, "pipeline": 2},
    {"name": "T 0.7 seeded, no pipeline", "sampling": {"temperature": 0.7}, "seeded": True, "pipeline": 0},
    {"name": "T 0.7 seeded, pipeline 2", "sampling": {"temperature": 0.7}, "seeded": True, "pipeline": 2},
)


async def run_all(target: Path, draft: Path, prompts, new_tokens: int, gamma: int, max_gamma: int, log=print):
    from edge_client.drafter import DrafterConfig, LlamaDrafter
    from tools.rig.netdelay import DelayConfig, DelayProxy
    from tools.rig.serverproc import ServerProcess

    n_ctx = max(map(len, prompts)) + new_tokens + 2 * gamma + 16
    rows = []
    with ServerProcess(target, "--max-gamma", str(max_gamma), "--prefix-cache-mb", "0") as server:
        host, port = server.address.rsplit(":", 1)
        async with DelayProxy(DelayConfig(host, int(port), 0.0)) as proxy:
            for arm in ARMS:
                drafter = LlamaDrafter(DrafterConfig(draft, n_ctx=n_ctx, n_threads=1))
                row = await measure(prompts, drafter, arm, new_tokens, gamma, proxy)
                log(json.dumps({k: v for k, v in row.items() if k != "largest_hex"}))
                rows.append(row)
    edge_worst = max(r["largest_worst_ids_numbers"] for r in rows)
    largest_row = max(rows, key=lambda r: r["largest_frame"])
    largest = pb.EdgeMessage.FromString(bytes.fromhex(largest_row["largest_hex"]))
    contract_worst = frame_bytes(worst_case(largest, assumed=max_gamma + 1))
    return {
        "gamma": gamma,
        "max_gamma": max_gamma,
        "new_tokens": new_tokens,
        "prompts": len(prompts),
        "rows": rows,
        "edge_worst_frame": edge_worst,
        "contract_worst_frame": contract_worst,
        "contract_assumed_ids": max_gamma + 1,
        "budget": BUDGET,
    }


def markdown(report: dict) -> str:
    lines = [
        f"γ {report['gamma']}, verifier max_gamma {report['max_gamma']}, {report['prompts']} "
        f"{report.get('prompt_set', 'chat')} prompts per arm, {report['new_tokens']} new tokens a session "
        "(EOS ignored), live llama.cpp draft",
        "",
        "| arm | rounds | stale | accept | γ sent (max) | assumed ids (max) | proposal frame B mean | max "
        "| proposal B/round | gRPC B/round (open incl.) | TCP B/round | max frame, ids and numbers at the "
        "contract's largest |",
        "|" + "---|" * 12,
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['arm']} | {r['rounds']} | {r['stale']} | {r['acceptance']:.2f} | {r['gamma_max']} "
            f"| {r['assumed_max']} | {r['proposal_frame_mean']:.1f} | {r['proposal_frame_max']} "
            f"| {r['proposal_bytes_per_round']:.1f} | {r['grpc_bytes_per_round']:.1f} "
            f"| {r['tcp_bytes_per_round']:.1f} | {r['largest_worst_ids_numbers']} |"
        )
    lines += [
        "",
        f"Worst case of a proposal the edge builds at γ {report['gamma']} (round and start position "
        f"2^64 - 1, every id 2^32 - 1): **{report['edge_worst_frame']} bytes** with gRPC's prefix. "
        f"The contract's worst case (also {report['contract_assumed_ids']} assumed ids, max_gamma + 1): "
        f"**{report['contract_worst_frame']} bytes**. Budget: {report['budget']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from draftwire_cli.models import smollm2
    from draftwire_cli.models.prompts import PROMPT_SETS, prompt_set

    home = smollm2.default_dir()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=home / "target")
    ap.add_argument("--draft", type=Path, default=home / "draft-q4_1.gguf")
    ap.add_argument("--prompt-set", choices=PROMPT_SETS, default="chat")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--max-gamma", type=int, default=16, help="the verifier's (serve's default: 16)")
    ap.add_argument("--out", type=Path, default=Path("runs/upload"))
    args = ap.parse_args(argv)
    prompts = prompt_set(args.prompt_set, args.target, args.prompts)
    report = asyncio.run(
        run_all(args.target, args.draft, prompts, args.new_tokens, args.gamma, args.max_gamma, log=print)
    )
    report["prompt_set"] = args.prompt_set
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"upload-{args.prompt_set}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / f"upload-{args.prompt_set}.md").write_text(table + "\n")
    print(table)
    return 0 if max(report["edge_worst_frame"], report["contract_worst_frame"]) <= BUDGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
