"""A verifier and a draft on one machine (`draftwire demo`): the process's CPUs divided between them as two
devices would have them (draftwire.cpus.split), and the speed that gives, measured once against the
target alone on every CPU (docs/sharing.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from draftwire import cpus
from draftwire.contract import SamplingParams, SessionSpec

MESSAGE = "Write a Python function that returns the sum of a list."  # a chat turn for the code pair
TOKENS = 64  # a reply's length for the measurement (end of sequence ignored, so both sides decode as many)
STEPS = 16  # the target alone's decode steps timed (target_alone)


@dataclass(frozen=True)
class Measured:
    speculation_tps: float  # tokens a second, the demo's settings on the divided CPUs
    alone_tps: float  # the target alone, greedy, on every CPU the process may use, as `serve` runs it
    alone_threads: int  # torch's threads for it (draftwire.cpus.threads)
    tokens: int
    split: cpus.Split

    @property
    def ratio(self) -> float:
        return self.speculation_tps / self.alone_tps

    def line(self) -> str:
        return (
            f"{self.split.describe()}; speculation {self.speculation_tps:.1f} tokens/s, {self.ratio:.2f}x "
            f"the target alone ({self.alone_tps:.1f} tokens/s, {self.alone_threads} threads on "
            f"{len(set(self.split.verifier) | set(self.split.draft))} CPUs), measured on a "
            f"{self.tokens}-token reply"
        )


async def prompt_ids(engine, drafter) -> list[int]:
    """MESSAGE as the target's chat template has it (a plain prompt where it has none)."""
    from edge_client.chat import chat_prompt_async

    info = SimpleNamespace(target=engine.info)
    return await chat_prompt_async(info, drafter, [{"role": "user", "content": MESSAGE}])


def target_alone(engine, prompt: list[int], tokens: int = TOKENS, steps: int = STEPS) -> tuple[float, int]:
    """The target alone's tokens a second over a greedy reply of `tokens`, on the caller's CPUs and
    torch's threads as they are (as `serve` runs it), and those threads. Its prefill and first token are
    timed, then the same with `steps` tokens more; the reply's other steps are counted at the mean of
    those (a step's cost barely moves over a short reply: 2 s where a whole 64-token reply took 6-7.6 s,
    SmolLM2 on 2 cores)."""
    import torch

    first = _reply_seconds(engine, prompt, 1)
    step = max(0.0, _reply_seconds(engine, prompt, 1 + steps) - first) / steps
    return tokens / (first + (tokens - 1) * step), torch.get_num_threads()


def _reply_seconds(engine, prompt: list[int], tokens: int) -> float:
    from verifier_service.session import reference_decode

    start = time.perf_counter()
    reference_decode(engine, SessionSpec(tuple(prompt), SamplingParams(), tokens, ignore_eos=True))
    return time.perf_counter() - start


def divide(split: cpus.Split) -> None:
    """Gives the calling thread (the event loop, which starts the verifier's threads) and torch's threads
    the verifier's share of `split`; the drafter takes the rest (load_drafter)."""
    import torch

    if not split.shared:
        cpus.pin(split.verifier)
        torch.set_num_threads(len(split.verifier))


def load_drafter(draft_path: Path, split: cpus.Split):
    from edge_client.drafter import DrafterConfig, LlamaDrafter

    return LlamaDrafter(DrafterConfig(draft_path, cpus=() if split.shared else split.draft))


async def speculation(session, prompt: list[int], config, tokens: int = TOKENS) -> float:
    """Tokens a second of one greedy reply through `session`, with the chat's γ and depth (`config`)."""
    from edge_client.planner import GenerationRequest, GenerationStats

    request = GenerationRequest(
        tuple(prompt), SamplingParams(), tokens, config.gamma, ignore_eos=True, pipeline=config.pipeline
    )
    stats = GenerationStats()
    start = time.perf_counter()
    async for _ in session.generate(request, stats):
        pass
    return stats.generated_tokens / (time.perf_counter() - start)
