"""Device check (issue 58): the verifier on a GPU, in one command that writes a JSON file and a markdown
summary. On random-weight models of real shapes, saved in bfloat16 as Qwen's checkpoints are: the
Qwen2.5-1.5B config whole and the 7B's at full width with 4 of its 28 layers, so that its loads fit the
run's 8 minutes (--layers sets every model's); --size small: two shrunken Qwen2 configs, for a CPU in CI.

- invariance at load: TargetEngine.load proves float32 and bfloat16 (exact, or refused with its reason);
- served tokens: 16 sessions at once (the server batches them) through the real gRPC verifier on loopback,
  session i at γ = 1 + i % 8, drafted by replaying the reference output with 30 % of the draft tokens
  corrupted, greedy and seeded, in every dtype that loaded exact, must equal `reference` (the target
  alone) token for token;
- the exact kernels' cost against plain ones (the engine with invariant=False, under torch's own
  settings): a prefill, a verify batch of 16 sessions x 5 positions and a decode step over a held context
  of random keys and values (tools.bench.invariance's cases);
- capacity: one verify round of N sessions x (γ + 1) positions against one target-only decode step of N
  sessions (plain kernels: a server without draftwire; exact ones too) over the held context. A round
  commits (1 - a^(γ+1)) / (1 - a) tokens per session at acceptance a (the accepted drafts and the target's
  own token); a decode step commits one. Reported at a = 0.85 (the goal's) and 0.733 (the Qwen pair's
  measured chat acceptance).

Only the exactness checks decide the exit status: 1 when a served token differs from `reference`, or when
a model has no exact dtype at all; the goals (exact in bfloat16, exactness at most 25 % dearer than plain
kernels on the verify batch, capacity at least 2.5x target-only serving at 64 sessions at 0.85) are
reported as pass/fail lines. The exactness checks of every model run first and whole; the measurements
follow, and those not begun when --budget-s has passed are skipped, and listed as such.

    python -m tools.bench.gpu_check [--device cuda|cpu] [--size real|small] [--out DIR] [--layers N]
        [--budget-s S]
    scripts/gpu_check.sh ...   (the same from a checkout, after installing wheels/ on a machine without
                                a package registry)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from draftwire import wire
from draftwire.contract import SamplingParams, SessionSpec
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, Timeouts
from tools.bench.invariance import SESSIONS, EngineArm, cases, interleaved
from verifier_service.cuda import CudaSettings
from verifier_service.engine import TargetEngine
from verifier_service.gamma_cap import CapConfig
from verifier_service.numerics import cpu_model
from verifier_service.servicer import ServerConfig, start_server
from verifier_service.session import reference_decode
from verifier_service.settings import PrefixCacheConfig, VerifierLimits

DTYPES = ("float32", "bfloat16")
ACCEPTANCES = {"goal": 0.85, "Qwen pair, chat": 0.733}
GOAL_ACCEPTANCE = ACCEPTANCES["goal"]
GOAL_SESSIONS, GOAL_CAPACITY, GOAL_COST = 64, 2.5, 1.25
PATIENT = Timeouts(verdict_s=600.0)  # a GPU's first forwards compile kernels: no verdict deadline to miss
CORRUPT = 0.3  # each replayed draft token is off the script with this probability
VERIFY_CASE = "verify"  # the cost case the goal reads (tools.bench.invariance.cases names it so)
# No kept caches (every session prefills its own prompt), and no γ cap under load: each session keeps its γ.
SERVER = ServerConfig(
    port=0,
    limits=VerifierLimits(max_gamma=8),
    prefix_cache=PrefixCacheConfig(),
    gamma_cap=CapConfig(enabled=False),
)


@dataclass(frozen=True)
class Shape:
    """A Qwen2 config's shape."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    layers_of: int = 0  # the real model's layer count, where this shape cuts it

    def config(self) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tied,
            max_position_embeddings=32768,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            bos_token_id=None,
            eos_token_id=1,  # word_tokenizer's <eos>
        )


QWEN_1_5B = Shape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, tied=True)
QWEN_7B = Shape("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, tied=False)


@dataclass(frozen=True)
class Plan:
    """What one --size runs."""

    shapes: tuple[Shape, ...]
    sessions: tuple[int, ...]  # capacity: N sessions per forward
    gammas: tuple[int, ...]  # capacity: draft tokens per round
    held: int  # cached positions of every timed forward
    prefill: int  # prompt length of the prefill case
    new_tokens: int  # served check: tokens per session
    repeats: int  # timed calls per figure (median), after a warm-up
    budget_s: float  # measurements start no later than this after the start


PLANS = {
    # Full widths; the 7B's layers cut to 4 so that its four loads and fills fit the run's 8 minutes.
    "real": Plan(
        shapes=(QWEN_1_5B, replace(QWEN_7B, layers=4, layers_of=QWEN_7B.layers)),
        sessions=(1, 16, 64, 256),
        gammas=(4, 6),
        held=512,
        prefill=2000,
        new_tokens=24,
        repeats=3,
        budget_s=360,
    ),
    # The same family shrunk for a CPU: a tied and an untied model, as the real pair.
    "small": Plan(
        shapes=(
            Shape("Qwen2.5-1.5B shrunk", 128, 384, 2, 4, 2, 1024, tied=True),
            Shape("Qwen2.5-7B shrunk", 192, 512, 2, 6, 2, 1024, tied=False),
        ),
        sessions=(1, 16, 64),
        gammas=(4, 6),
        held=256,
        prefill=256,
        new_tokens=24,
        repeats=3,
        budget_s=75,
    ),
}


@dataclass(frozen=True)
class LoadProof:
    model: str
    dtype: str
    exact: bool
    seconds: float
    numerics: str = ""  # the engine's numerics identity where it loaded
    passed_over: tuple[str, ...] = ()
    refusal: str = ""  # why it did not load exact


@dataclass(frozen=True)
class ServedCheck:
    model: str
    dtype: str
    sampling: str  # greedy or seeded
    gammas: tuple[int, ...]  # session i's γ
    new_tokens: int
    mismatched: tuple[int, ...]  # sessions whose tokens differ from reference
    acceptance: float  # accepted draft tokens / draft tokens
    draft_per_round: float  # draft tokens / verified rounds: the sessions' γ, short rounds at the end
    mean_batch: float  # sessions per forward pass, as the sessions' rounds saw it
    seconds: float

    @property
    def exact(self) -> bool:
        return not self.mismatched


@dataclass(frozen=True)
class Cost:
    model: str
    dtype: str
    forward: str
    plain_ms: float
    exact_ms: float

    @property
    def ratio(self) -> float:
        return self.exact_ms / self.plain_ms


@dataclass(frozen=True)
class Capacity:
    model: str
    dtype: str
    sessions: int
    gamma: int
    verify_ms: float  # one round of sessions x (γ + 1) positions, exact kernels
    decode_plain_ms: float  # one target-only step of sessions x 1 position, plain kernels
    decode_exact_ms: float  # the same, exact kernels

    def verified_per_s(self, acceptance: float) -> float:
        return self.sessions * verified_per_round(acceptance, self.gamma) / (self.verify_ms / 1000)

    def target_only_per_s(self, exact: bool = False) -> float:
        return self.sessions / ((self.decode_exact_ms if exact else self.decode_plain_ms) / 1000)

    def ratio(self, acceptance: float, exact: bool = False) -> float:
        """Verified tokens/s against target-only serving's at the same session count."""
        return self.verified_per_s(acceptance) / self.target_only_per_s(exact)

    def figures(self) -> dict:
        return {
            f"at {a}": {
                "verified_tokens_per_s": self.verified_per_s(a),
                "ratio_to_plain_target_only": self.ratio(a),
                "ratio_to_exact_target_only": self.ratio(a, exact=True),
            }
            for a in ACCEPTANCES.values()
        } | {
            "target_only_tokens_per_s": {
                "plain": self.target_only_per_s(),
                "exact": self.target_only_per_s(True),
            }
        }


@dataclass(frozen=True)
class Goal:
    name: str
    passed: bool | None  # None: not measured
    detail: str


@dataclass(frozen=True)
class Failure:
    stage: str
    error: str
    exactness: bool  # a stage of the exactness checks: fails the run


@dataclass
class Report:
    device: str
    size: str
    environment: dict
    shapes: list[Shape]
    loads: list[LoadProof] = field(default_factory=list)
    served: list[ServedCheck] = field(default_factory=list)
    cost: list[Cost] = field(default_factory=list)
    capacity: list[Capacity] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what was not measured, and why
    failures: list[Failure] = field(default_factory=list)
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # per model, per phase
    total_s: float = 0.0

    @property
    def exact(self) -> bool:
        """What decides the exit status: every model has a dtype that loaded exact, every served token
        equals reference, and no stage of these checks failed."""
        every_model = all(any(p.exact for p in self.loads if p.model == s.name) for s in self.shapes)
        served = all(c.exact for c in self.served) and not any(f.exactness for f in self.failures)
        return every_model and served

    def as_json(self) -> dict:
        out = asdict(self)
        out["capacity"] = [asdict(c) | c.figures() for c in self.capacity]
        out["cost"] = [asdict(c) | {"ratio": c.ratio} for c in self.cost]
        out["goals"] = [asdict(g) for g in goals(self)]
        out["exact"] = self.exact
        return out


def verified_per_round(acceptance: float, gamma: int) -> float:
    """Tokens a round of γ draft tokens commits on average when each is accepted with probability
    `acceptance` independently until the first rejection: the accepted ones and the target's own token."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


# ---------------------------------------------------------------------------------------------------------
# Models


def word_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """A tokenizer that names every id of the model's vocabulary (<unk>, <eos>, then t2, t3, ...), so that
    the served vocabulary is the model's whole; prompts are ids, and no text is ever split."""
    vocab = {"<unk>": 0, "<eos>": 1} | {f"t{i}": i for i in range(2, size)}
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")


def build(shape: Shape, out_dir: Path, device: torch.device) -> Path:
    """A random-weight model of `shape` (initialised on `device`, seeded) saved in bfloat16 with its
    tokenizer: a transformers directory TargetEngine.load takes."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape.config(), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    word_tokenizer(shape.vocab).save_pretrained(out_dir)
    return out_dir


def load(
    model_dir: Path, shape: Shape, device: str, dtype: str, invariant: bool, kernels: str = "auto"
) -> tuple[TargetEngine | None, LoadProof]:
    """The engine of `model_dir` in `dtype`; in invariant mode the load proves it exact here, on the
    `kernels` backend, or refuses."""
    start = time.perf_counter()
    try:
        engine = TargetEngine.load(
            model_dir, device=device, dtype=dtype, invariant=invariant, kernels=kernels
        )
    except (ValueError, RuntimeError) as e:  # NoExactPath, UnsupportedModel; a device's own failure
        return None, LoadProof(
            shape.name, dtype, False, time.perf_counter() - start, refusal=f"{type(e).__name__}: {e}"
        )
    proof = LoadProof(
        shape.name,
        dtype,
        engine.numerics.exact,
        time.perf_counter() - start,
        engine.numerics.identity,
        engine.passed_over,
    )
    return engine, proof


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# Served tokens against reference


SAMPLINGS: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(),
    "seeded": lambda i: SamplingParams(0.8, top_p=0.95, seed=1000 + i),
}


def prompts(vocab: int, count: int = SESSIONS, seed: int = 7) -> list[tuple[int, ...]]:
    """`count` prompts of 4 to 40 random ids (no <unk> or <eos>)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(2, vocab) for _ in range(rng.randint(4, 40))) for _ in range(count)]


async def wave(
    engine: TargetEngine, drafters: Sequence[ReplayDrafter], requests: Sequence[GenerationRequest]
) -> list[tuple[list[int], GenerationStats]]:
    """Every request at once, each from an edge session of its own on one channel to the real verifier
    server on loopback, started here over `engine` and stopped after."""
    server, port = await start_server(engine, SERVER)
    try:
        async with wire.insecure_channel(f"127.0.0.1:{port}") as channel:
            sessions = [EdgeSession(channel, d, PATIENT) for d in drafters]
            return list(await asyncio.gather(*(s.run(r) for s, r in zip(sessions, requests, strict=True))))
    finally:
        await server.stop(None)


def served(engine: TargetEngine, model: str, dtype: str, new_tokens: int) -> list[ServedCheck]:
    """16 sessions served at once, greedy and seeded, against `reference` of each."""
    vocabulary = engine.info.vocabulary
    opening = prompts(vocabulary.size)
    gammas = tuple(1 + i % 8 for i in range(len(opening)))
    checks = []
    for name, sampling in SAMPLINGS.items():
        specs = [SessionSpec(p, sampling(i), new_tokens, ignore_eos=True) for i, p in enumerate(opening)]
        expected = [reference_decode(engine, spec) for spec in specs]
        drafters = [
            ReplayDrafter((*s.prompt_token_ids, *e), vocabulary, corrupt=CORRUPT, seed=i)
            for i, (s, e) in enumerate(zip(specs, expected, strict=True))
        ]
        requests = [
            GenerationRequest(s.prompt_token_ids, s.sampling, new_tokens, gamma=g, ignore_eos=True)
            for s, g in zip(specs, gammas, strict=True)
        ]
        start = time.perf_counter()
        results = asyncio.run(wave(engine, drafters, requests))
        seconds = time.perf_counter() - start
        stats = [s for _, s in results]
        checks.append(
            ServedCheck(
                model,
                dtype,
                name,
                gammas,
                new_tokens,
                tuple(i for i, ((ids, _), e) in enumerate(zip(results, expected, strict=True)) if ids != e),
                sum(s.accepted_tokens for s in stats) / max(1, sum(s.draft_tokens for s in stats)),
                sum(s.draft_tokens for s in stats) / max(1, sum(s.rounds for s in stats)),
                sum(s.batched_with for s in stats) / max(1, sum(s.rounds for s in stats)),
                seconds,
            )
        )
    return checks


# ---------------------------------------------------------------------------------------------------------
# Timing: exact against plain, and capacity


class PlainArm:
    """A plain engine's arm run under torch's own settings (those a server without draftwire runs), not
    those an exact load in this process set."""

    def __init__(self, arm: EngineArm, settings: CudaSettings):
        self.arm, self.settings = arm, settings

    def prefill(self, ids: list[int]) -> None:
        with self.settings.applied():
            self.arm.prefill(ids)

    def rows(self, ids: list[list[int]], held: int) -> None:
        with self.settings.applied():
            self.arm.rows(ids, held)


class Budget:
    """The run's time: measurements begun after `seconds` are skipped."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    @property
    def spent(self) -> bool:
        return time.perf_counter() - self.start > self.seconds


def syncer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def cost(model: str, dtype: str, arms: dict[str, object], plan: Plan, sync: Callable[[], None]) -> list[Cost]:
    """tools.bench.invariance's cases, exact against plain."""
    rows = []
    for name, call in cases(plan.prefill, plan.held, _vocab(arms)).items():
        ms = interleaved(call, arms, plan.repeats, sync)
        rows.append(Cost(model, dtype, name, ms["plain"], ms["exact"]))
    return rows


def _vocab(arms: dict[str, object]) -> int:
    exact = arms["exact"]
    assert isinstance(exact, EngineArm)
    return exact.engine.info.vocabulary.size


def capacity(
    model: str,
    dtype: str,
    arms: dict[str, object],
    plan: Plan,
    sync: Callable[[], None],
    budget: Budget,
    skipped: list[str],
) -> list[Capacity]:
    """A verify round of N sessions x (γ + 1) positions (exact) and a decode step of N x 1 (plain and
    exact), for every N and γ of the plan, over the held context."""
    rng = random.Random(3)
    vocab = _vocab(arms)
    rows = []
    for n in plan.sessions:
        if budget.spent:
            skipped.append(f"capacity of {model} in {dtype} at {n} sessions")
            continue
        step = [[rng.randrange(vocab)] for _ in range(n)]
        decode = interleaved(lambda arm, step=step: arm.rows(step, plan.held), arms, plan.repeats, sync)
        for gamma in plan.gammas:
            batch = [[rng.randrange(vocab) for _ in range(gamma + 1)] for _ in range(n)]
            verify = interleaved(
                lambda arm, batch=batch: arm.rows(batch, plan.held),
                {"exact": arms["exact"]},
                plan.repeats,
                sync,
            )
            rows.append(Capacity(model, dtype, n, gamma, verify["exact"], decode["plain"], decode["exact"]))
    return rows


# ---------------------------------------------------------------------------------------------------------
# One model, and the run


@dataclass
class Loaded:
    exact: dict[str, TargetEngine] = field(default_factory=dict)
    plain: dict[str, TargetEngine] = field(default_factory=dict)

    def capacity_dtype(self) -> str | None:
        """bfloat16 where it loaded exact (a GPU's dtype), else float32."""
        both = [d for d in ("bfloat16", "float32") if d in self.exact and d in self.plain]
        return both[0] if both else None


@dataclass
class Check:
    """One run: the plan, where it runs, and the report it fills (written after every stage, so that a run
    cut short keeps what it found)."""

    plan: Plan
    device: torch.device
    report: Report
    out: Path
    budget: Budget
    defaults: CudaSettings  # torch's settings before any exact load changed them
    kernels: str = "auto"  # the exact backend (auto: portable on a GPU, onednn on a CPU that has it)

    @contextlib.contextmanager
    def stage(self, what: str, exactness: bool) -> Iterator[None]:
        """A stage whose exception is reported and passed over, so that a device run always writes its
        report; one in a stage of the exactness checks fails the run."""
        try:
            yield
        except Exception as e:
            traceback.print_exc()
            self.report.failures.append(Failure(what, f"{type(e).__name__}: {e}", exactness))

    def timed(self, model: str, phase: str) -> contextlib.AbstractContextManager[None]:
        return _timed(self.report.seconds.setdefault(model, {}), phase)

    def prove(self, shape: Shape, workdir: Path) -> Loaded:
        """Builds one model, proves it at load in every dtype and checks its served tokens: the exactness
        checks, which run first and whole, whatever the budget."""
        loaded = Loaded()
        with self.stage(f"build and load {shape.name}", exactness=True):
            with self.timed(shape.name, "build"):
                model_dir = build(shape, workdir / shape.name.replace(" ", "-"), self.device)
            with self.timed(shape.name, "loads"):
                self.load(shape, model_dir, loaded)
        for dtype, engine in loaded.exact.items():
            with (
                self.stage(f"served {shape.name} in {dtype}", exactness=True),
                self.timed(shape.name, "served"),
            ):
                self.report.served += served(engine, shape.name, dtype, self.plan.new_tokens)
        write(self.report, self.out)
        return loaded

    def timing(self, shape: Shape, loaded: Loaded) -> None:
        """Times one model, as far as the budget goes, and frees its engines."""
        with self.stage(f"timing {shape.name}", exactness=False), self.timed(shape.name, "timing"):
            self.measure(shape.name, loaded)
        loaded.exact.clear()
        loaded.plain.clear()
        free(self.device)
        write(self.report, self.out)

    def load(self, shape: Shape, model_dir: Path, loaded: Loaded) -> None:
        """Every dtype in invariant mode (the proofs), then plain where it loaded exact."""
        for dtype in DTYPES:
            engine, proof = load(model_dir, shape, str(self.device), dtype, True, self.kernels)
            self.report.loads.append(proof)
            if engine is not None:
                loaded.exact[dtype] = engine
        for dtype in loaded.exact:
            engine, proof = load(model_dir, shape, str(self.device), dtype, invariant=False)
            if engine is None:
                self.report.skipped.append(f"plain {dtype} of {shape.name} ({proof.refusal})")
            else:
                loaded.plain[dtype] = engine

    def measure(self, model: str, loaded: Loaded) -> None:
        """Exact against plain in every dtype that has both, capacity in one (first: the goals read it)."""
        plan, sync, report = self.plan, syncer(self.device), self.report
        chosen = loaded.capacity_dtype()
        for dtype in sorted(DTYPES, key=lambda d: d != chosen):
            if dtype not in loaded.exact or dtype not in loaded.plain:
                continue
            if self.budget.spent:
                report.skipped.append(f"exact against plain, and capacity, of {model} in {dtype}")
                continue
            sessions = max(SESSIONS, *plan.sessions) if dtype == chosen else SESSIONS
            exact = EngineArm(loaded.exact[dtype], plan.held, sessions)
            plain = PlainArm(EngineArm(loaded.plain[dtype], plan.held, sessions), self.defaults)
            arms: dict[str, object] = {"plain": plain, "exact": exact}
            report.cost += cost(model, dtype, arms, plan, sync)
            if dtype == chosen:
                report.capacity += capacity(model, dtype, arms, plan, sync, self.budget, report.skipped)


@contextlib.contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def environment(device: torch.device) -> dict:
    env = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cpu": cpu_model() or platform.processor(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def sized(plan: Plan, layers: int | None) -> Plan:
    """The plan with every model at `layers` layers (None: as planned)."""
    if not layers:
        return plan
    cut = tuple(replace(s, layers=layers, layers_of=s.layers_of or s.layers) for s in plan.shapes)
    return replace(plan, shapes=cut)


def run(
    device: str,
    size: str,
    out: Path,
    layers: int | None = None,
    budget_s: float | None = None,
    kernels: str = "auto",
) -> Report:
    plan = sized(PLANS[size], layers)
    dev = torch.device(device)
    report = Report(device, size, environment(dev) | {"kernels": kernels}, list(plan.shapes))
    budget = Budget(budget_s if budget_s is not None else plan.budget_s)
    check = Check(plan, dev, report, out, budget, CudaSettings.read(), kernels)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        # Every model's engines stay loaded until its timing: a GPU holds them all (about 45 GB at real).
        proven = [(shape, check.prove(shape, Path(workdir))) for shape in plan.shapes]
    for shape, loaded in proven:
        check.timing(shape, loaded)
    report.total_s = time.perf_counter() - budget.start
    write(report, out)
    return report


def write(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report.as_json(), indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


# ---------------------------------------------------------------------------------------------------------
# Goals and the summary


def goals(report: Report) -> list[Goal]:
    return [exact_goal(report), cost_goal(report), capacity_goal(report)]


def exact_goal(report: Report) -> Goal:
    name = "exact in bfloat16"
    proofs = [p for p in report.loads if p.dtype == "bfloat16"]
    if not proofs:
        return Goal(name, None, "not measured")
    refused = [f"{p.model}: {p.refusal}" for p in proofs if not p.exact]
    checks = [c for c in report.served if c.dtype == "bfloat16"]
    sessions = sum(len(c.gammas) for c in checks)
    equal = sessions - sum(len(c.mismatched) for c in checks)
    detail = f"proven at load on {len(proofs) - len(refused)} of {len(proofs)} models"
    detail += f"; served tokens equal reference in {equal} of {sessions} sessions"
    if refused:
        detail += "; refused: " + "; ".join(refused)
    return Goal(name, not refused and bool(checks) and equal == sessions, detail)


def cost_goal(report: Report) -> Goal:
    name = f"exactness costs at most {GOAL_COST - 1:.0%} against plain kernels (verify batch, bfloat16)"
    rows = [c for c in report.cost if c.dtype == "bfloat16" and c.forward.startswith(VERIFY_CASE)]
    if not rows:
        return Goal(name, None, "not measured")
    detail = ", ".join(f"{c.model}: {c.ratio:.2f}x" for c in rows)
    return Goal(name, all(c.ratio <= GOAL_COST for c in rows), detail)


def capacity_goal(report: Report) -> Goal:
    name = (
        f"verification capacity at least {GOAL_CAPACITY}x target-only serving at {GOAL_SESSIONS} sessions "
        f"at acceptance {GOAL_ACCEPTANCE}"
    )
    rows = [c for c in report.capacity if c.sessions == GOAL_SESSIONS]
    if not rows:
        return Goal(name, None, f"not measured at {GOAL_SESSIONS} sessions")
    best = {}
    for c in rows:
        if c.model not in best or c.ratio(GOAL_ACCEPTANCE) > best[c.model].ratio(GOAL_ACCEPTANCE):
            best[c.model] = c
    detail = ", ".join(
        f"{c.model} ({c.dtype}, γ {c.gamma}): {c.ratio(GOAL_ACCEPTANCE):.2f}x plain, "
        f"{c.ratio(GOAL_ACCEPTANCE, exact=True):.2f}x exact target-only"
        for c in best.values()
    )
    return Goal(name, all(c.ratio(GOAL_ACCEPTANCE) >= GOAL_CAPACITY for c in best.values()), detail)


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def markdown(report: Report) -> str:
    env = report.environment
    cuda = f"CUDA {env['cuda']}" if env["cuda"] else "no CUDA"
    lines = [
        f"# GPU check: the verifier on {env.get('gpu') or env['cpu']}",
        "",
        f"{env['when']}; --device {report.device} --size {report.size} "
        f"--kernels {env.get('kernels', 'auto')}; torch {env['torch']} ({cuda}), "
        f"transformers {env['transformers']}, Python {env['python']}; {report.total_s:.0f} s in all.",
        "",
        f"Random-weight models, stored in bfloat16: {shapes_line(report.shapes)}.",
        "",
        "## Goals",
        "",
    ]
    for g in goals(report):
        mark = "not measured" if g.passed is None else ("PASS" if g.passed else "FAIL")
        lines.append(f"- **{mark}** {g.name}: {g.detail}")
    verdict = "the exactness checks passed" if report.exact else "AN EXACTNESS CHECK FAILED"
    lines += ["", f"Exit status {0 if report.exact else 1}: {verdict}."]
    for f in report.failures:
        lines.append(f"- {'exactness ' if f.exactness else ''}stage failed: {f.stage}: {f.error}")
    sections = (
        ("Invariance at load", load_table),
        ("Served tokens against `reference` (16 sessions at once, γ 1 to 8, replayed drafts)", served_table),
        ("Exact kernels against plain ones (median ms)", cost_table),
        ("Capacity: verified tokens/s against target-only serving", capacity_table),
    )
    for title, rows in sections:
        lines += ["", f"## {title}", "", *rows(report)]
    if report.skipped:
        lines += ["", "Not measured: " + "; ".join(report.skipped) + "."]
    phases = "; ".join(
        f"{model}: " + ", ".join(f"{phase} {s:.0f}" for phase, s in seconds.items())
        for model, seconds in report.seconds.items()
    )
    lines += ["", f"Seconds: {phases}."]
    return "\n".join(lines) + "\n"


def shapes_line(shapes: Sequence[Shape]) -> str:
    def one(s: Shape) -> str:
        layers = f"{s.layers} of {s.layers_of} layers" if s.layers_of else f"{s.layers} layers"
        return (
            f"{s.name} ({layers}, hidden {s.hidden}, MLP {s.intermediate}, {s.heads} heads, "
            f"{s.kv_heads} KV heads, vocabulary {s.vocab}, {'tied' if s.tied else 'untied'})"
        )

    return ", ".join(one(s) for s in shapes)


def load_table(report: Report) -> list[str]:
    return table(
        ("model", "dtype", "exact", "numerics", "load s", "refusal"),
        [
            (
                p.model,
                p.dtype,
                "yes" if p.exact else "no",
                p.numerics or "-",
                f"{p.seconds:.1f}",
                p.refusal or "-",
            )
            for p in report.loads
        ],
    )


def served_table(report: Report) -> list[str]:
    return table(
        (
            "model",
            "dtype",
            "sampling",
            "sessions equal",
            "acceptance",
            "draft / round",
            "mean batch",
            "served s",
        ),
        [
            (
                c.model,
                c.dtype,
                c.sampling,
                f"{len(c.gammas) - len(c.mismatched)} of {len(c.gammas)}",
                f"{c.acceptance:.2f}",
                f"{c.draft_per_round:.1f}",
                f"{c.mean_batch:.1f}",
                f"{c.seconds:.1f}",
            )
            for c in report.served
        ],
    )


def cost_table(report: Report) -> list[str]:
    return table(
        ("model", "dtype", "forward", "plain", "exact", "exact / plain"),
        [
            (c.model, c.dtype, c.forward, f"{c.plain_ms:.1f}", f"{c.exact_ms:.1f}", f"{c.ratio:.2f}")
            for c in report.cost
        ],
    )


def capacity_table(report: Report) -> list[str]:
    head = [
        "model",
        "dtype",
        "sessions",
        "γ",
        "verify ms",
        "decode ms plain / exact",
        "target-only tok/s plain",
    ]
    for a in ACCEPTANCES.values():
        head += [f"verified tok/s at {a}", f"ratio at {a} (plain / exact)"]
    rows = []
    for c in report.capacity:
        row = [
            c.model,
            c.dtype,
            c.sessions,
            c.gamma,
            f"{c.verify_ms:.1f}",
            f"{c.decode_plain_ms:.1f} / {c.decode_exact_ms:.1f}",
            f"{c.target_only_per_s():.0f}",
        ]
        for a in ACCEPTANCES.values():
            row += [f"{c.verified_per_s(a):.0f}", f"{c.ratio(a):.2f} / {c.ratio(a, exact=True):.2f}"]
        rows.append(row)
    return table(head, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=tuple(PLANS), help="default: real on cuda, small on cpu")
    ap.add_argument("--out", type=Path, default=Path("docs/runs/gpu_check"))
    ap.add_argument("--layers", type=int, help="every model's layer count (default: the size's)")
    ap.add_argument("--budget-s", type=float, help="no measurement starts after this (default: the size's)")
    ap.add_argument(
        "--kernels",
        choices=("auto", "onednn", "portable"),
        default="auto",
        help="the exact backend (auto: portable on a GPU; --kernels portable runs a GPU's on a CPU)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    size = args.size or ("real" if args.device == "cuda" else "small")
    transformers.utils.logging.disable_progress_bar()  # the loads' bars would bury the summary
    report = run(args.device, size, args.out, args.layers, args.budget_s, args.kernels)
    sys.stdout.write(markdown(report))
    return 0 if report.exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
