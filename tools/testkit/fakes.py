"""Fakes for the in-process test tier: a target engine with deterministic logits, a verifier for the
planner, and a drafter that is wrong where it is told to be. Nothing here loads a model or opens a socket.

The fake target's greedy choice after a token t is `successor(t)`, so a test can say what the target
writes; its logits are peaked there and spread elsewhere, so sampling has something to choose from.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from draftwire.contract import (
    Finish,
    Numerics,
    Proposal,
    SamplingParams,
    SessionSpec,
    TargetInfo,
    Verdict,
    generation_budget,
    is_stale,
    stop_set,
)
from draftwire.rules import commit_round
from draftwire.vocab import Vocabulary
from edge_client.planner import Planner

VOCAB = 64
EOS = 1


def successor(token: int, vocab: int = VOCAB) -> int:
    """The fake target's greedy token after `token` (never EOS unless the test asks for it)."""
    return (token * 7 + 3) % (vocab - 2) + 2


def target_continuation(sequence: Sequence[int], count: int) -> list[int]:
    """The fake target's greedy continuation of `sequence`."""
    out, last = [], sequence[-1]
    for _ in range(count):
        last = successor(last)
        out.append(last)
    return out


def fake_info(vocab: int = VOCAB, max_context: int = 256) -> TargetInfo:
    return TargetInfo(
        target_id="fake",
        vocabulary=Vocabulary(size=vocab, fingerprint="fake"),
        max_context=max_context,
        bos_token_id=None,
        eos_token_ids=(EOS,),
        pad_token_id=None,
        chat_template="",
    )


class FakeEngine:
    """The verifier's engine contract (verifier_service.batcher.ServedEngine: `forward_many`, `release`,
    `adopt`, `info`, and what a server reads besides, with no kept caches) over per-session lengths
    instead of KV caches, so that a real server runs over it in process. Records every batch it runs."""

    def __init__(self, info: TargetInfo | None = None):
        import torch  # the engine's contract is torch logits; the edge's fakes below need no torch

        self._torch = torch
        self.info = info or fake_info()
        self.numerics = Numerics("float32", "fake", "cpu", True)
        self.held: dict[str, int] = {}  # positions each session's "cache" holds
        self.batches: list[list] = []  # the forwards of each engine call, in order
        self.released: list[str] = []
        self.slow_s = 0.0  # each call takes at least this long, as a real forward would
        self.slow_per_position_s = 0.0  # and this much more per position it computes
        self.slow_per_context_s = 0.0  # and this much per position it computes per position before it
        # What the servicer reads of a real engine: nothing is kept, nothing is active.
        self.prefix_cache: dict = {}
        self.cache_bytes = 0
        self.active_sessions = 0
        self.bytes_per_position = 0  # nothing to reserve: admission by memory admits every session
        self.device = "cpu"

    def keep_finished(self, config, room=None) -> None:
        """The servicer's prefix-cache setting; the fake keeps no caches."""

    def forward_many(self, forwards):
        if self.slow_s or self.slow_per_position_s or self.slow_per_context_s:
            positions = sum(len(f.token_ids) for f in forwards)
            context = sum(len(f.token_ids) * (f.keep + len(f.token_ids) / 2) for f in forwards)  # attention
            time.sleep(self.slow_s + self.slow_per_position_s * positions + self.slow_per_context_s * context)
        if len({f.key for f in forwards}) != len(forwards):
            raise ValueError("one forward per session in a batch")
        self.batches.append(list(forwards))
        out = []
        for f in forwards:
            held = self.held.get(f.key, 0)
            if f.keep > held:
                raise ValueError(f"session {f.key} holds {held} positions, cannot keep {f.keep}")
            self.held[f.key] = f.keep + len(f.token_ids)
            out.append(self.logits(f.token_ids) if f.wants_logits else None)
        return out

    def logits(self, token_ids: Sequence[int]):
        """# [len(token_ids), vocab]: row i peaks at successor(token_ids[i])."""
        torch, vocab = self._torch, self.info.vocabulary.size
        rows = torch.stack([torch.cos(torch.arange(vocab) * (t + 1) * 0.37) for t in token_ids])
        rows[torch.arange(len(token_ids)), torch.tensor([successor(t, vocab) for t in token_ids])] += 4.0
        return rows.float()

    def release(self, key: str) -> None:
        if self.held.pop(key, None) is not None:
            self.released.append(key)

    def adopt(self, key: str, token_ids, owner: str = "", max_positions: int | None = None) -> int:
        return 0  # keeps no finished session


@dataclass
class FakeVerifier:
    """A verifier for the planner's tests, in process and torch-free: the contract's staleness,
    budget and stop rules over the fake target's greedy choices, with the real `commit_round`."""

    spec: SessionSpec
    max_context: int = 256
    committed: list[int] = field(default_factory=list)
    finish: Finish | None = None
    last_round: int = 0
    gamma_cap: int = 0  # what every verdict advertises (Verdict.gamma_cap); a test may change it mid-run

    def __post_init__(self) -> None:
        self.committed = [*self.spec.prompt_token_ids, *self.spec.generated_token_ids]
        prompt = len(self.spec.prompt_token_ids)
        self.budget = generation_budget(self.spec.max_new_tokens, self.max_context, prompt)
        self.stops = stop_set(self.spec.stop_token_ids, self.spec.ignore_eos, (EOS,))

    def answer(self, p: Proposal) -> Verdict:
        assert p.round == self.last_round + 1, f"round {p.round} after {self.last_round}"
        self.last_round = p.round
        length = len(self.committed)
        if is_stale(self.committed, p):
            return Verdict(
                p.round, p.start_position, 0, None, None, True, length, 0, gamma_cap=self.gamma_cap
            )
        assert self.finish is None, "a live proposal after the finish"
        left = self.budget - (length - len(self.spec.prompt_token_ids))
        draft = list(p.draft_token_ids[: left - 1])
        target = [successor(t) for t in [self.committed[-1], *draft]]
        accepted, token, self.finish = commit_round(draft, target, self.stops, left)
        self.committed += [*draft[:accepted], *([token] if token is not None else [])]
        return Verdict(
            p.round,
            p.start_position,
            accepted,
            token,
            self.finish,
            False,
            len(self.committed),
            0,
            gamma_cap=self.gamma_cap,
        )


@dataclass
class MistakenDrafter:
    """Drafts the fake target's greedy tokens, except at the absolute positions in `wrong`."""

    wrong: Collection[int] = ()
    vocabulary: Vocabulary = field(default_factory=lambda: fake_info().vocabulary)
    executor = None
    calls: int = 0

    def propose(
        self,
        sequence: Sequence[int],
        gamma: int,
        params: SamplingParams,
        stop_token_ids: Collection[int] = (),
        prompt_length: int = 0,
    ) -> list[int]:
        self.calls += 1
        draft, last = [], sequence[-1]
        for position in range(len(sequence), len(sequence) + gamma):
            last = successor(last)
            draft.append((last + 1) % VOCAB if position in self.wrong else last)
            if draft[-1] in stop_token_ids:
                break
        return draft


@dataclass
class ScriptedDrafter:
    """Drafts a known continuation of each prompt (for instance the target's own output, from an
    independent reference), one token wrong at every `wrong_every`-th generated position: rounds on a
    real target then accept whole drafts, part of one and none. `inner` lends the vocabulary (a real
    drafter's, whose fingerprint the verifier checks)."""

    scripts: dict[tuple[int, ...], list[int]]  # prompt -> the tokens that follow it
    inner: object
    wrong_every: int = 5
    executor = None

    @property
    def vocabulary(self) -> Vocabulary:
        return self.inner.vocabulary

    def propose(self, sequence, gamma, params, stop_token_ids=(), prompt_length=0) -> list[int]:
        prompt = next(p for p in self.scripts if tuple(sequence[: len(p)]) == p)
        done = len(sequence) - len(prompt)
        wrong = {i for i in range(done, done + gamma) if i % self.wrong_every == self.wrong_every - 1}
        script = self.scripts[prompt][done : done + gamma]
        return [(t + 1) % self.vocabulary.size if i in wrong else t for i, t in enumerate(script, start=done)]


class Paced:
    """A real drafter that takes `delay_s` per proposal, on a thread of its own: a generation lasts long
    enough to be drained or disturbed mid-way."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s, self.vocabulary = inner, delay_s, inner.vocabulary
        self.executor = ThreadPoolExecutor(max_workers=1)

    def propose(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self.inner.propose(*args, **kwargs)


def drive(
    request, info, drafter: MistakenDrafter, lag: int = 0, generated=(), tuner=None, caps=None
) -> tuple[Planner, list]:
    """The transport's loop without a network, for the planner's tests: a proposal reaches the fake
    verifier at once, and its verdict reaches the planner only once `lag` later proposals were sent (or
    when the planner must wait). `caps(round)`: the γ cap the verdict of that round advertises (none
    when None). Returns the planner and the proposals sent."""
    plan = Planner(request, info, generated, tuner=tuner)
    verifier = FakeVerifier(request.spec(generated))
    on_the_way: collections.deque = collections.deque()
    sent = []
    while not plan.finished:
        if len(on_the_way) > lag:
            plan.apply(on_the_way.popleft())
        elif (proposal := plan.next_proposal()) is not None:
            sent.append(proposal)
            verifier.gamma_cap = caps(proposal.round) if caps else 0
            on_the_way.append(verifier.answer(proposal))
        elif (job := plan.next_draft()) is not None:
            plan.add_draft(job, drafter.propose(job.base, job.gamma, request.sampling, plan.stops))
        else:
            plan.apply(on_the_way.popleft())
    return plan, sent
