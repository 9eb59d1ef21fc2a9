"""`draftwire models check`: does a draft GGUF pair with a target directory, how often does it agree
with the target, and what speedup do the measured costs promise on this machine.

1. The pairing, as a verifier decides it: both vocabularies id by id (the first differing id and both
   sides' view of it where they differ), the family (docs/families.md) and the checks at load.
2. Agreement: the target's greedy output on a few held-out prompts (through the engine, `reference`),
   and the draft's greedy choice after every prefix of it (teacher-forced): the share it gets right,
   per draft position as a speculative round meets it.
3. Costs, measured here: the draft's seconds per call against tokens drafted, the target's per forward
   against positions; then edge_client.adaptive's model of tokens per second (the one the edge's tuner
   chooses with) gives the best (γ, depth) and its speedup over the target alone, for a round trip
   given by --rtt-ms. Draft and target take turns on this machine's cores here; deployed, they run on
   different machines, which is what the model assumes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from draftwire import cpus
from draftwire.contract import SamplingParams, SessionSpec
from draftwire.vocab import compare_vocabularies, tokens_from_hf, tokens_from_llama
from edge_client.speed_model import Estimates, best_setting, tokens_per_second


@dataclass
class Report:
    accepted: bool
    reason: str  # why not, or what runs
    agreement: float | None = None  # the draft's greedy choice equals the target's, over all positions
    acceptance: tuple[float, ...] = ()  # per draft position i: right given positions 0..i-1 right
    positions: int = 0  # positions compared
    draft_token_ms: float | None = None
    target_position_ms: float | None = None  # one position alone (the target alone's cost a token)
    target_threads: int = 0  # torch's threads the target was timed with: serve's (draftwire.cpus.threads)
    verify_ms: dict[int, float] | None = None  # positions -> ms of one forward
    best: tuple[int, int] | None = None  # (γ, depth)
    speedup: float | None = None  # model's tokens/s at best over the target alone's
    rtt_ms: float = 0.0
    chat_templates_equal: bool | None = None

    def lines(self) -> list[str]:
        out = [f"pair: {'accepted' if self.accepted else 'refused'}: {self.reason}"]
        if self.chat_templates_equal is not None:
            out.append(f"chat templates: {'equal' if self.chat_templates_equal else 'differ'}")
        if self.agreement is None:
            return out
        rates = ", ".join(f"{a:.2f}" for a in self.acceptance[:4])
        out.append(
            f"agreement: {self.agreement:.3f} over {self.positions} positions (greedy, teacher-forced); "
            f"by draft position: {rates}"
        )
        verify = ", ".join(f"{n}: {ms:.1f}" for n, ms in sorted((self.verify_ms or {}).items()))
        out.append(
            f"costs here: draft {self.draft_token_ms:.1f} ms/token; target {self.target_position_ms:.1f} ms "
            f"alone ({self.target_threads} threads, as serve takes them), a forward of n positions (ms) "
            f"{verify}"
        )
        gamma, depth = self.best
        out.append(
            f"expected: {self.speedup:.2f}x the target alone at γ {gamma}, depth {depth}, round trip "
            f"{self.rtt_ms:g} ms (draft and target on separate machines)"
        )
        return out


def check_pair(
    target_dir: Path,
    draft_path: Path,
    prompts: Sequence[Sequence[int]] | None = None,
    new_tokens: int = 32,
    rtt_ms: float = 20.0,
    dtype: str = "auto",
    kernels: str = "auto",
    device: str = "auto",
    log: Callable[[str], None] = lambda _: None,
) -> Report:
    """Checks the pair; `prompts` default to 3 held-out chat turns (code windows where the target has
    no chat template). Raises OSError or ValueError where either side cannot be read at all."""
    with vocabularies(target_dir, draft_path) as (tokenizer, vocab_only, mismatch):
        draft_template = vocab_only.metadata.get("tokenizer.chat_template")
    templates = _templates_equal(draft_template, tokenizer.chat_template)
    if mismatch is not None:
        return Report(False, mismatch, chat_templates_equal=templates)

    from edge_client.drafter import DrafterConfig, LlamaDrafter
    from verifier_service.engine import NoExactPath, TargetEngine, UnsupportedModel
    from verifier_service.numerics import NoSuchDevice

    log("loading the target (the checks at load run: conformance, invariance)")
    import torch

    torch.set_num_threads(cpus.threads())  # as `serve` runs it (draftwire_cli.serving.load_target)
    try:
        engine = TargetEngine.load(target_dir, device, dtype=dtype, kernels=kernels)
    except (UnsupportedModel, NoExactPath, NoSuchDevice) as e:
        return Report(False, str(e), chat_templates_equal=templates)
    n = engine.numerics
    reason = f"same vocabulary ({engine.info.vocabulary.describe()}); target {n.dtype}, {n.kernels}"
    report = Report(True, reason, rtt_ms=rtt_ms, chat_templates_equal=templates)
    report.target_threads = torch.get_num_threads()
    drafter = LlamaDrafter(DrafterConfig(draft_path, n_ctx=0))
    prompts = prompts or _default_prompts(target_dir, tokenizer)
    outputs = []
    for prompt in prompts:
        log(f"target: {new_tokens} tokens after a prompt of {len(prompt)}")
        outputs.append(_reference(engine, prompt, new_tokens))
    _measure_agreement(report, drafter, prompts, outputs)
    _measure_costs(report, engine, drafter, prompts[0])
    estimates = Estimates(
        acceptance=_extend(report.acceptance, 9),
        draft_fixed_s=0.0,
        draft_token_s=report.draft_token_ms / 1e3,
        verify_fixed_s=_line(report.verify_ms)[0] / 1e3,
        verify_position_s=_line(report.verify_ms)[1] / 1e3,
        rtt_s=rtt_ms / 1e3,
    )
    report.best = best_setting(estimates, range(1, 9), range(0, 3))
    alone = 1e3 / report.target_position_ms  # the target alone: one forward a token, streamed
    report.speedup = tokens_per_second(estimates, *report.best) / alone
    return report


@contextlib.contextmanager
def vocabularies(target_dir: Path, draft_path: Path) -> Iterator[tuple[object, object, str | None]]:
    """The target's tokenizer, the draft's vocabulary-only llama.cpp model (closed after), and where
    their vocabularies differ (draftwire.vocab.compare_vocabularies; None: they do not)."""
    from transformers import AutoConfig, AutoTokenizer

    from edge_client.llama_runtime import Llama

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    size = getattr(AutoConfig.from_pretrained(target_dir).get_text_config(), "vocab_size", None)
    vocab_only = Llama(model_path=str(draft_path), vocab_only=True, verbose=False)
    try:
        yield (
            tokenizer,
            vocab_only,
            compare_vocabularies(tokens_from_llama(vocab_only), tokens_from_hf(tokenizer, size)),
        )
    finally:
        vocab_only.close()


def _templates_equal(draft: str | None, target: str | None) -> bool | None:
    if not draft and not target:
        return None
    return (draft or "").strip() == (target or "").strip()


def _default_prompts(target_dir: Path, tokenizer) -> list[tuple[int, ...]]:
    from draftwire_cli.models.prompts import heldout_prompts, prompt_set

    if tokenizer.chat_template:
        return list(prompt_set("chat", target_dir, 3))
    return list(heldout_prompts(target_dir, 3, 24))


def _reference(engine, prompt: Sequence[int], new_tokens: int) -> list[int]:
    from verifier_service.session import reference_decode

    return reference_decode(engine, SessionSpec(tuple(prompt), SamplingParams(), new_tokens))


def _measure_agreement(report: Report, drafter, prompts, outputs) -> None:
    """Teacher-forced greedy agreement, and α_i: of the positions where the draft was right i times in
    a row before (from the start of a round anywhere), the share it gets right next."""
    right: list[bool] = []
    runs: list[list[bool]] = []
    for prompt, output in zip(prompts, outputs, strict=True):
        hits = []
        for i, token in enumerate(output):
            [guess] = drafter.propose([*prompt, *output[:i]], 1, SamplingParams())
            hits.append(guess == token)
        right += hits
        runs.append(hits)
    report.positions = len(right)
    report.agreement = sum(right) / len(right) if right else 0.0
    reached, hit = [0] * 9, [0] * 9
    for hits in runs:
        for start in range(len(hits)):
            for k in range(min(9, len(hits) - start)):
                reached[k] += 1
                hit[k] += hits[start + k]
                if not hits[start + k]:
                    break
    report.acceptance = tuple(h / r if r else report.agreement for h, r in zip(hit, reached, strict=True))


def _measure_costs(report: Report, engine, drafter, prompt: Sequence[int], repeats: int = 5) -> None:
    """Medians of `repeats`, each after one untimed run of the same shape (the first run of a shape
    builds its kernels, as Batcher.calibrate's first pass does): the draft's seconds a token (γ 8 from a
    synced prefix), the target's forward of 1, 2, 5 and 9 positions after the prompt."""
    sequence = list(prompt)

    def median(f) -> float:
        f()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3

    drafter.propose(sequence, 1, SamplingParams())  # the prompt evaluated once, outside the timing
    report.draft_token_ms = median(lambda: drafter.propose(sequence, 8, SamplingParams())) / 8
    key = "models-check"
    engine.forward(key, 0, sequence[:-1], wants_logits=False)
    keep = len(sequence) - 1
    report.verify_ms = {
        n: median(lambda n=n: engine.forward(key, keep, [sequence[-1]] + [sequence[0]] * (n - 1)))
        for n in (1, 2, 5, 9)
    }
    engine.release(key)
    report.target_position_ms = report.verify_ms[1]


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (fixed, per position) through (positions, ms), both at least 0."""
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _extend(rates: tuple[float, ...], n: int) -> tuple[float, ...]:
    return tuple(rates[i] if i < len(rates) else rates[-1] for i in range(n))


def as_json(report: Report) -> dict:
    return asdict(report)
