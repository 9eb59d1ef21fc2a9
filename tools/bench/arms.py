"""What the speed benches share: their configuration, their rows, the sampling of a mode, and the
address an edge dials at a simulated RTT. `speed` (the arms (c) and (d)), `target_arms` (the target alone
and transformers' own speculation, in a child process) and `adaptive` build on it."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from draftwire.contract import SamplingParams
from tools.rig.netdelay import DelayConfig, DelayProxy


def add_pair_flags(p: argparse.ArgumentParser, temperature: float) -> None:
    """The flags of a bench over one pair on the two-device rig, which BenchConfig.from_args reads
    (besides --gammas and --rtts, each bench's own): the pair, the prompts, the rig, the sampled mode's
    temperature (`temperature` its default) and the target's numerics."""
    from draftwire_cli.cliargs import add_target_numerics, rig
    from draftwire_cli.models.prompts import PROMPT_SETS

    p.add_argument("--target", type=Path, required=True, help="transformers target directory")
    p.add_argument("--draft", type=Path, required=True, help="GGUF draft for the edge")
    p.add_argument("--prompts", type=int, default=3, help="held-out prompts per point")
    p.add_argument("--prompt-tokens", type=int, default=48, help="length of the code prompts")
    p.add_argument("--chat", action="store_true", help="held-out chat turns instead of code (a chat target)")
    p.add_argument(
        "--prompt-set",
        choices=PROMPT_SETS,
        help="a class of held-out turns for a chat target (draftwire_cli.models.prompts), instead of --chat",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-threads", type=int, default=1, help="llama.cpp threads of the draft")
    p.add_argument("--two-device", metavar="EDGE_CPUS:VERIFIER_CPUS", type=rig, default=((), ()))
    p.add_argument("--temperature", type=float, default=temperature, help="of the seeded sampled runs")
    add_target_numerics(p)


@dataclass(frozen=True)
class BenchConfig:
    target_dir: Path  # transformers target
    draft_gguf: Path  # the edge's draft
    draft_hf: Path | None  # the draft's transformers form, for assisted generation; None skips (b)
    prompts: tuple[tuple[int, ...], ...]  # prompt ids
    max_new_tokens: int = 64
    gammas: tuple[int, ...] = (1, 2, 4, 6, 8)
    rtts_ms: tuple[float, ...] = (10, 30, 80)
    delay_gamma: int = 4  # gamma of the delayed arms
    pipelines: tuple[int, ...] = (0, 2)  # pipeline depths of every draftwire arm (0: none)
    # llama.cpp threads of the draft. The edge and the verifier share this machine's cores here, and
    # OpenMP workers that spin between calls take them from each other; on a device the draft has its own.
    draft_threads: int = 1
    verifier_threads: int = 0  # torch threads of the verifier process; 0: torch's choice
    edge_cpus: tuple[int, ...] = ()  # cores of this process (drafter, edge session); () leaves it be
    verifier_cpus: tuple[int, ...] = ()  # cores of the verifier and of arms (a), (b); one torch thread each
    temperature: float = 0.7  # the sampled mode; greedy always runs
    dtype: str = "auto"  # the target's, in every arm (TargetEngine.load)
    invariant: bool = True  # bit-exact kernels in arms (a) and (c), (d) (TargetEngine.load)
    kernels: str = "auto"  # their backend (TargetEngine.load)
    seed: int = 1234

    @property
    def devices(self) -> dict:
        """The two-device rig's arguments (tools.rig.devices.verifier)."""
        return {
            "edge_cpus": self.edge_cpus,
            "verifier_cpus": self.verifier_cpus,
            "threads": self.verifier_threads,
        }

    @classmethod
    def from_args(cls, args, **fields) -> BenchConfig:
        """From the flags every bench takes (--target, --draft, --prompts, --chat, --prompt-tokens,
        --max-new-tokens, --gammas, --rtts, --draft-threads, --two-device, --temperature, --dtype,
        --no-bit-exact, and --draft-hf where it has one); `fields` set the rest."""
        from draftwire_cli.models.prompts import chat_prompts, heldout_prompts, prompt_set

        if getattr(args, "prompt_set", None):
            prompts = prompt_set(args.prompt_set, args.target, args.prompts)
        elif args.chat:
            prompts = chat_prompts(args.target, args.prompts)
        else:
            prompts = heldout_prompts(args.target, args.prompts, args.prompt_tokens)
        return cls(
            target_dir=args.target,
            draft_gguf=args.draft,
            draft_hf=getattr(args, "draft_hf", None),
            prompts=prompts,
            max_new_tokens=args.max_new_tokens,
            gammas=args.gammas,
            rtts_ms=args.rtts,
            draft_threads=args.draft_threads,
            edge_cpus=args.two_device[0],
            verifier_cpus=args.two_device[1],
            temperature=args.temperature,
            dtype=args.dtype,
            invariant=args.invariant,
            kernels=args.kernels,
            **fields,
        )


@dataclass
class Row:
    arm: str  # a, b, c, d
    label: str
    mode: str  # greedy or sampled
    gamma: int = 0
    rtt_ms: float = 0.0
    pipeline: int = 0  # proposals sent ahead of their verdicts
    tokens: int = 0
    wall_s: float = 0.0
    acceptance: float | None = None
    tokens_per_round: float | None = None
    expected_tokens_per_round: float | None = None  # (1 - a^(g+1)) / (1 - a)
    target_positions_per_token: float | None = None
    bytes_per_token: float | None = None
    round_ms_p50: float | None = None
    round_ms_p99: float | None = None
    draft_ms_per_round: float | None = None
    verify_ms_per_round: float | None = None
    wire_ms_per_round: float | None = None  # send-to-verdict time not spent verifying
    stale_per_round: float | None = None  # pipelined proposals that came back stale, per verified round
    drafts_per_round: float | None = None  # drafter calls per verified round (GenerationStats.drafts)
    restarts_per_round: float | None = None  # drafts with nothing live in flight (GenerationStats.restarts)
    plain_steps: int = 0  # rounds of no draft token: speculation off (edge_client.adaptive)
    server_tokens: int = 0  # decoded by the verifier alone: speculation off, handed off
    reused_positions: int = 0  # prompt positions the verifier took from kept caches, over the row's opens
    speculation_offs: int = 0  # times the row's tuner turned speculation off, and probed it
    probes: int = 0
    speculation_reason: str = ""  # the tuner's last reason
    model_tokens_per_s: float | None = None  # what the edge's tuner predicted for the row's (final) setting
    tuner_rtt_ms: float | None = None  # the tuner's round-trip estimate (R) at the row's end
    # The tuner's view at the row's end (speed.tuner_view): acceptance by position, and the seconds it
    # holds for each size it drafted and verified, with their counts, beside the lines it fits.
    tuner: dict | None = None
    # The adaptive row's settings in the order its tuner took them, each [γ, depth, verified rounds played
    # at it] (Tuner.path): where its learning went.
    tuner_path: list[list[int]] | None = None
    speedup: float | None = None  # tokens/s over arm (a) in the same mode
    bound_tokens_per_s: float | None = None  # zero_overhead_bound
    share_of_bound: float | None = None  # tokens/s over the bound
    repeat: int = 0  # which pass of a point played it (tools.bench.adaptive --repeats)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def params_for(mode: str, config: BenchConfig, index: int) -> SamplingParams:
    """The sampling of prompt `index` in a mode: greedy, or seeded sampling with a seed per prompt."""
    if mode == "greedy":
        return SamplingParams()
    return SamplingParams(temperature=config.temperature, seed=config.seed + index)


@contextlib.asynccontextmanager
async def route(host: str, port: int, rtt_ms: float):
    """The address edges dial: the server itself, or a delaying proxy in front of it."""
    if not rtt_ms:
        yield f"{host}:{port}"
        return
    async with DelayProxy(DelayConfig(host, port, rtt_ms / 1000)) as proxy:
        yield proxy.address
