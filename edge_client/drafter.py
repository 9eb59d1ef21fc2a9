"""The drafter: a GGUF draft model run by llama.cpp, tokens in, draft tokens out.

Its KV cache survives across rounds: before drafting, it is cut back to the longest prefix it shares
with the committed tokens (llama.cpp's memory sequence removal) and only the new committed tokens
are evaluated, never the whole sequence again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftwire import cpus
from draftwire.contract import Constraint, SamplingParams
from draftwire.grammar import InvalidConstraint, Matcher, compile_constraint, table_tokenizer
from draftwire.rules import adjusted_logits, choose_tokens, masked_logits
from draftwire.vocab import Vocabulary, tokens_from_llama, vocabulary_from_llama
from edge_client.llama_runtime import Llama
from edge_client.planner import DraftTokens


@dataclass(frozen=True)
class DrafterConfig:
    model_path: Path  # GGUF file of the draft
    n_ctx: int = 0  # context of the draft's KV cache; 0 takes the model's training context
    n_threads: int = 0  # 0: one per CPU of `cpus`, or of this process's affinity (draftwire.cpus)
    cpus: tuple[int, ...] = ()  # the CPUs the draft's threads run on (empty: the process's own)


def grammar_tokenizer(llm, eos_token_ids: list[int]):
    """llguidance's tokenizer over a GGUF's vocabulary: the token table its fingerprint covers
    (draftwire.vocab), as the verifier builds its own from transformers' table, so that where the two
    fingerprints agree each id means the same to both sides' masks (a user-defined token such as Qwen2's
    `<tool_call>` is text on both; a token llama.cpp promotes to control at load keeps its stored type)."""
    table = tokens_from_llama(llm)

    def tokenize(text: bytes) -> list[int]:
        return llm.tokenize(text, add_bos=False, special=False)

    return table_tokenizer(table.tokens, tokenize, eos_token_ids)


class VocabOnly:
    """A GGUF's vocabulary alone (llama.cpp's vocab_only: no weights): how a thin client, which drafts
    nothing, tokenizes its text and reads the verifier's tokens back."""

    def __init__(self, model_path: Path):
        self.llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        self.vocabulary: Vocabulary = vocabulary_from_llama(self.llm)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def detokenize(self, token_ids: Sequence[int]) -> bytes:
        return self.llm.detokenize(list(token_ids))


class LlamaDrafter(VocabOnly):
    def __init__(self, config: DrafterConfig):
        """Loads the GGUF; raises ValueError (from llama-cpp-python) when it cannot."""
        self.config = config
        # llama.cpp's OpenMP team belongs to the thread that decodes. Decoding from a new thread each
        # time (asyncio.to_thread) starts a team per thread, and once the spinning workers outnumber
        # the cores OpenMP throttles them all: a proposal took 1.9 ms instead of 1.2 (gamma 4, demo
        # draft, 2 cores). Every propose of this drafter runs on this one thread.
        # Pinned where asked (draftwire.cpus.split): the thread's OpenMP team inherits its CPUs.
        pin = (lambda: cpus.pin(config.cpus)) if config.cpus else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter", initializer=pin)
        threads = config.n_threads or (len(config.cpus) if config.cpus else cpus.threads())
        self.llm = Llama(
            model_path=str(config.model_path),
            n_ctx=config.n_ctx,
            # llama-cpp-python's defaults count every core of the machine (half of them for n_threads,
            # all for n_threads_batch), whatever the process's affinity: on a device pinned to fewer
            # cores (and with torch's OpenMP runtime loaded, as in the bench) its spinning workers
            # made a 40-token eval 25x slower (7.5 s against 0.3 s). One thread per usable CPU.
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        self.vocabulary: Vocabulary = vocabulary_from_llama(self.llm)
        self._cached: list[int] = []  # tokens whose keys and values the draft's cache holds
        self.evaluated_positions = 0  # positions the draft computed, for the cost accounting
        self._grammar_tokenizer = None  # llguidance's, from the GGUF's vocabulary (constraint_matcher)

    @property
    def n_ctx(self) -> int:
        return self.llm.n_ctx()

    def propose(
        self,
        sequence: Sequence[int],
        gamma: int,
        params: SamplingParams,
        stop_token_ids: Collection[int] = (),
        prompt_length: int = 0,
        matcher: Matcher | None = None,
        most: int = 0,
    ) -> DraftTokens:
        """Drafts up to `gamma` tokens after `sequence` (the committed tokens, then any the edge assumes
        will be; the prompt its `prompt_length` first), choosing each with the verifier's rules (the
        session's logit bias and penalties over the tokens before it, the constraint's mask when
        `matcher` is given, then its choice with keyed noise), so that it proposes what the target would
        choose; stops early after a stop token, since nothing after one can be committed.

        Where the constraint allows one token alone (a JSON key, a brace, a quote: llguidance's
        fast-forward tokens), the target takes it too: it is appended with no draft step and counts
        nothing of γ, up to `most` tokens in all (0: `gamma`), and llama.cpp runs a run of them at once
        with the next token's step. The result names them (DraftTokens.forced)."""
        if not sequence:
            raise ValueError("cannot draft from an empty sequence")
        self._sync(sequence)
        generated = list(sequence[prompt_length:])
        # A sequence the draft's matcher refuses (it cannot, where both sides mask alike): draft unmasked.
        masked = matcher is not None and matcher.follow(generated) == len(generated)
        draft: list[int] = []
        forced: list[int] = []  # indexes of draft the constraint forced
        pending: list[int] = []  # drafted, not yet run through the draft model
        chosen, most = 0, max(most, gamma)
        while len(draft) < most:
            new = matcher.forced()[: most - len(draft)] if masked else []
            forced += range(len(draft), len(draft) + len(new))
            if not new:
                if chosen == gamma:
                    break
                self._eval(pending)
                pending = []
                scores = adjusted_logits(
                    self._last_logits()[None], params, [*sequence, *draft], prompt_length
                )
                if masked:
                    scores = masked_logits(scores, matcher.allowed()[None])
                new = [int(choose_tokens(scores, len(sequence) + len(draft), params)[0])]
                chosen += 1
            stop = next((i for i, t in enumerate(new) if t in stop_token_ids), None)
            if stop is not None:
                return DraftTokens(draft + new[: stop + 1], forced)
            draft += new
            pending += new
            if masked and matcher.follow([*generated, *draft]) < len(generated) + len(draft):
                break
        return DraftTokens(draft, forced)

    def constraint_matcher(self, constraint: Constraint, eos_token_ids: Sequence[int]) -> Matcher | None:
        """A matcher of `constraint` over the draft's own vocabulary, ending at the target's
        `eos_token_ids` as the verifier's does (the tokenizer built once, about a second for a
        vocabulary of 150k), or None where it does not compile here (the verifier says why)."""
        eos = list(eos_token_ids) or [self.llm.token_eos()]
        if self._grammar_tokenizer is None or self._grammar_tokenizer.eos_tokens != eos:
            self._grammar_tokenizer = grammar_tokenizer(self.llm, eos)
        try:
            return compile_constraint(constraint, self._grammar_tokenizer)
        except InvalidConstraint:
            return None

    def _sync(self, sequence: Sequence[int]) -> None:
        # Keep the longest shared prefix, but re-run at least the last token: its logits are what the
        # first draft token is chosen from.
        keep = 0
        limit = min(len(self._cached), len(sequence) - 1)
        while keep < limit and self._cached[keep] == sequence[keep]:
            keep += 1
        self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
        self.llm.n_tokens = keep
        del self._cached[keep:]
        self._eval(list(sequence[keep:]))

    def _eval(self, tokens: list[int]) -> None:
        if not tokens:
            return
        self.llm.eval(tokens)
        self._cached += tokens
        self.evaluated_positions += len(tokens)

    def _last_logits(self) -> np.ndarray:
        ptr = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
