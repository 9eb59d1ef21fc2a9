"""The target engine: a transformers causal LM that keeps one KV cache per session.

A session's cache holds every committed position but the last committed token; a forward first cuts
the cache back to the positions the caller keeps, then runs the new tokens on top of it, so a round
costs gamma + 1 positions and never recomputes the prefix. A finished session's cache can be kept a
while (`PrefixCache`): a new session whose tokens start with a kept one's adopts it, so the next turn
of a conversation computes only its new tokens. Cache layers append in place into spare
capacity. A batch of sessions runs as one packed sequence: the projections and MLPs see every row's
new positions one after another, with no padding, while each row's attention reads its own session's
cache where it lies: nothing is gathered, copied or padded per round.
"""

from __future__ import annotations

import gc
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from draftwire.contract import Numerics, TargetInfo
from draftwire.vocab import vocabulary_from_hf
from verifier_service import cuda, families, mapped
from verifier_service import invariant as invariant_
from verifier_service import numerics as numerics_
from verifier_service.attention_checks import (
    batched_attention_holds,
    check_attention,
    fused_attention_holds,
)
from verifier_service.invariant import NotInvariant, make_invariant
from verifier_service.kv import ROWS_ATTENTION, GrowingLayer, PrefixCache, RowsCache, SessionCache
from verifier_service.numerics import Hardware, NoExactPath
from verifier_service.settings import PrefixCacheConfig

UnsupportedModel = families.UnsupportedModel


@dataclass(frozen=True)
class Forward:
    key: str  # the session
    keep: int  # cached positions to keep; the rest is cut first
    token_ids: tuple[int, ...]  # new positions to run
    wants_logits: bool = True  # False skips the logits (prefill)


class TargetEngine:
    """Runs the target over new positions of a session; single-threaded by contract (callers
    serialise calls, e.g. on one executor thread)."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: TargetInfo,
        device: torch.device,
        invariant: bool = False,
        numerics: Numerics | None = None,
        kernels: str = "auto",
    ):
        """`invariant`: each position's logits bitwise independent of what else is in the forward
        (verifier_service/invariant.py), on the `kernels` backend (auto, onednn, portable); raises
        ValueError where there are no kernels for that, and NotInvariant where the kernels' check fails
        on this machine. `numerics`: what the engine reports as its numerics identity (default: read off
        this machine)."""
        try:
            model.set_attn_implementation(ROWS_ATTENTION)
        except ValueError as e:  # a model without attention layers transformers can route (recurrent)
            raise UnsupportedModel(f"the verifier cannot run {model.config.model_type} models: {e}") from e
        self.kernels = invariant_.resolve(kernels, model.dtype, device) if invariant else None
        # onednn pads a small call's rows to the fastest minimum here (invariant.choose_padding).
        self.padding = make_invariant(model, self.kernels) if invariant else None
        if invariant:  # the key blocks' attention, which every path falls back to
            check_attention(model.dtype, device)
        # Off a CPU, a layer's attention runs all its sessions in one set of calls where that gives each
        # query the bits it gets alone here (checked); on a CPU, one session at a time is faster (views of
        # the caches, no copies), and the same bits, through torch's fused kernel where that is proven.
        on_cpu = torch.device(device).type == "cpu"
        self.batched_attention = invariant and not on_cpu and batched_attention_holds(model.dtype, device)
        self.fused_attention = invariant and on_cpu and fused_attention_holds(model.dtype, device)
        self.invariant = invariant
        self.model = model
        self.info = info
        self.device = device
        dtype = str(model.dtype).removeprefix("torch.")
        self.numerics = numerics or Hardware.detect(device.type).numerics(dtype, invariant, self.kernels)
        self.passed_over: tuple[str, ...] = ()  # faster dtypes `load` tried and found not exact here
        self._layers = model.config.get_text_config().num_hidden_layers
        self._caches: dict[str, SessionCache] = {}
        self.prefix_cache = PrefixCache(PrefixCacheConfig())  # keeps nothing until configured
        self.tokenizer = None  # the target's transformers tokenizer, from `load`: structured output's

    @property
    def attention(self) -> str | None:
        """The batch's attention (kv.EXACT_ATTENTIONS), from what the load found here; None: plain."""
        if not self.invariant:
            return None
        return "batched" if self.batched_attention else "fused" if self.fused_attention else "blocks"

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: str | None = None,  # auto (None), cpu, cuda, cuda:N (numerics.resolve_device)
        dtype: str = "auto",
        invariant: bool = True,
        hardware: Hardware | None = None,
        kernels: str = "auto",
    ) -> TargetEngine:
        """Loads a transformers model directory in `dtype` ("float32", "bfloat16", or "auto": bfloat16
        where the CPU computes it natively, else float32, verifier_service/numerics.py), in invariant
        mode unless asked not to (`invariant=False` gives up bit-exactness against `reference`), on the
        `kernels` backend (auto: onednn on a CPU that has it, else portable). In invariant mode the
        dtype is proven at load: the kernels' checks, then `check_invariance`; auto falls back to the
        next dtype where that fails, with the copy of the one before freed first.

        Every engine is also checked against the model's own forward (`check_conformance`), in both
        modes.

        Raises OSError or ValueError from transformers when the directory holds no causal LM,
        UnsupportedModel (a ValueError) for an architecture the engine cannot serve right (docs/families.md),
        NoExactPath (a ValueError, with one line saying what is missing and the choices) where
        invariant mode cannot run the dtype asked for here, and NoSuchDevice (a ValueError) for a
        `device` this machine's torch does not have.
        """
        model_dir = Path(model_dir)
        hardware = hardware or Hardware.detect(device)
        named = device not in (None, "auto")
        dev = torch.device(
            numerics_.resolve_device(device, torch.cuda.device_count()) if named else hardware.device
        )
        if invariant and dev.type == "cuda":
            cuda.determinism()  # before the first cuBLAS call
        candidates = numerics_.plan(dtype, hardware, invariant, kernels)
        refusal = families.refusal(AutoConfig.from_pretrained(model_dir).model_type)
        if refusal is not None:
            raise UnsupportedModel(refusal)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        passed_over = []
        for name in candidates:
            last = name == candidates[-1]
            engine = cls._proven(
                model_dir, name, tokenizer, dev, (invariant, kernels), hardware, last, passed_over
            )
            if engine is not None:
                engine.passed_over, engine.tokenizer = tuple(passed_over), tokenizer
                mapped.trim_heap()  # what the proofs freed, back to the system
                return engine
            gc.collect()  # the copy that failed, before the next dtype's loads
        raise NoExactPath(
            f"no dtype is bit-exact on this machine ({'; '.join(passed_over)}): run with --no-bit-exact, "
            "which gives up output identical to the target alone"
        )

    @classmethod
    def _proven(
        cls, model_dir, name, tokenizer, dev, mode, hardware, last: bool, passed_over: list[str]
    ) -> TargetEngine | None:
        """The engine of `model_dir` in dtype `name` and `mode` (invariant, kernels), checked at load;
        None, with why appended to `passed_over`, where a check fails. Raises UnsupportedModel where
        the model's own forward is missed in the `last` dtype of the plan (see `load`)."""
        invariant, kernels = mode
        model = load_model(model_dir, getattr(torch, name)).to(dev).eval()
        info = target_info(model_name(model_dir), tokenizer, model.config)
        chosen = invariant_.resolve(kernels, model.dtype, dev) if invariant else None
        try:
            engine = cls(model, info, dev, invariant, hardware.numerics(name, invariant, chosen), kernels)
            engine.check_conformance()
            if invariant:
                engine.check_invariance()
            return engine
        except (NotInvariant, UnsupportedModel) as e:
            # A lower precision can miss the model's own forward by more than its tolerance where
            # float32 meets it: auto tries the next dtype; the last one, or a dtype asked for by name,
            # refuses.
            if isinstance(e, UnsupportedModel) and last:
                raise
            passed_over.append(f"{name}: {e}")
            return None

    def check_conformance(self, prompt: int = 10, gamma: int = 4, seed: int = 1) -> None:
        """Proves that the engine computes the model's own function: the logits of a prefill and two
        rounds through the sessions' caches and `rows_attention` equal, within float tolerance
        (families.TOLERANCE), the model's own forward over the whole sequence, through transformers'
        eager attention or, where that misses, its sdpa attention. An architecture whose attention or
        cache the engine does not reproduce (positions from the attention mask, ALiBi, recurrent state,
        a cache length per batch) fails here, at load, instead of serving wrong tokens. Raises
        UnsupportedModel. Costs 2 (prompt + 2 (γ + 1)) positions of forward, 3 where eager misses."""
        model_type = self.model.config.model_type
        prompt = max(1, min(prompt, self.info.max_context - 2 * (gamma + 1)))
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.info.vocabulary.size, (prompt + 2 * (gamma + 1),), generator=generator)
        key, step = "check-conformance", gamma + 1
        tolerance = families.TOLERANCE.get(self.numerics.dtype, families.TOLERANCE["bfloat16"])
        errors = []
        try:
            self.forward(key, 0, ids[:prompt].tolist(), wants_logits=False)
            ours = torch.cat(
                [self.forward(key, at, ids[at : at + step].tolist()) for at in (prompt, prompt + step)]
            )
            for attention in self._own_attentions():
                self.model.set_attn_implementation(attention)
                with torch.inference_mode():
                    own = self.model(input_ids=ids[None].to(self.device), use_cache=False).logits
                errors.append(
                    families.relative_error(ours, own[0, prompt:, : self.info.vocabulary.size].float().cpu())
                )
                if errors[-1] <= tolerance:
                    return
        except Exception as e:  # what transformers raises for a forward the engine cannot run
            raise UnsupportedModel(
                f"the verifier cannot run {model_type} models: {type(e).__name__}: {e}"
            ) from e
        finally:
            self._caches.pop(key, None)
            self.model.set_attn_implementation(ROWS_ATTENTION)
        raise UnsupportedModel(
            f"the verifier does not reproduce {model_type} models' own forward "
            f"(logits off by {min(errors):.1e} of their range in {self.numerics.dtype})"
        )

    def _own_attentions(self) -> tuple[str, ...]:
        """transformers' attentions the engine is checked against: eager, the one every family has, and
        sdpa where the model has it and it computes the same function. In bfloat16 eager rounds the
        scores to bfloat16 before the softmax: Qwen2.5-1.5B's logits were 0.106 of their range off its
        float32 forward that way, 0.019 through sdpa, which accumulates in float32 (as the engine does:
        0.020). sdpa drops Gemma 2's soft cap on the scores, so a capped model is checked by eager alone."""
        config = self.model.config
        capped = getattr(config, "attn_logit_softcapping", None) is not None
        sdpa = getattr(self.model, "_supports_sdpa", False) and not capped
        return ("eager", "sdpa") if sdpa else ("eager",)

    def check_invariance(self, prompt: int = 6, gamma: int = 4, seed: int = 0, long: int = 1100) -> None:
        """Proves invariant mode on this machine with the real model: the logits of γ + 1 positions
        computed one forward each equal, bit for bit, the same positions inside one γ + 1 forward and
        inside a ragged batch beside another session, after a short prompt and after a long context
        (`long` positions, past 1,024 keys and several key blocks, held as random keys and values so
        that the proof costs no long prefill). The three ways run on one session, cut back to the
        context before each, as a round after a rejection is. Raises NotInvariant otherwise. Costs
        about 6 (γ + 1) + 2 prompt positions of forward."""
        generator = torch.Generator().manual_seed(seed)
        size = self.info.vocabulary.size
        long = min(long, self.info.max_context - 2 * (gamma + 1))
        keys = [f"check-invariance-{i}" for i in range(2)]  # the session checked, its batch's company
        try:
            for context in (prompt, long):
                ids = torch.randint(0, size, (2, context + gamma + 1), generator=generator).tolist()
                for key, row in zip(keys, ids, strict=True):
                    if context == prompt:
                        self.forward(key, 0, row[:context], wants_logits=False)
                    else:
                        self._fill(key, row[:context], generator, room=gamma + 1)
                new = ids[0][context:]
                alone = torch.cat([self.forward(keys[0], context + i, [t]) for i, t in enumerate(new)])
                round_ = self.forward(keys[0], context, new)
                batch = self.forward_many(
                    [Forward(keys[0], context, tuple(new)), Forward(keys[1], context, (ids[1][context],))]
                )
                for where, logits in (("a γ + 1 forward", round_), ("a batch", batch[0])):
                    if not torch.equal(logits, alone):
                        raise NotInvariant(
                            f"{self.numerics.dtype} logits inside {where} differ from the same positions "
                            f"computed one at a time on this machine (after {context} positions)"
                        )
        finally:
            for key in keys:
                self._caches.pop(key, None)

    @torch.inference_mode()
    def _fill(self, key: str, tokens: list[int], generator: torch.Generator, room: int = 0) -> None:
        """Session `key`, which a forward has made, holding `tokens` with random keys and values of its
        layers' own shapes (the same for the same generator state): a long context for a check, without
        its prefill. Its capacity is made once for `room` positions more (else the check's round would
        double it: 2,560 positions held for 1,105)."""
        state = generator.get_state()
        cache = self._cut(key, 0)
        for layer in cache.layers:
            like = layer._keys  # [1, kv_heads, capacity, head_dim] as the model made it
            if like is None:  # a layer that keeps no cache of its own (Gemma 3n shares another's)
                continue
            shape = (*like.shape[:-2], len(tokens), like.shape[-1])
            states = [torch.randn(shape, generator=generator).to(like.device, like.dtype) for _ in "kv"]
            layer.reserve(states[0], len(tokens) + room)
            layer.append(*states)
        cache.tokens[:] = tokens
        generator.set_state(state)

    @property
    def active_sessions(self) -> int:
        return len(self._caches)

    @property
    def bytes_per_position(self) -> int:
        """KV memory one position of one session takes (keys and values, every layer): what admission
        by memory (verifier_service/admission.py) reckons with."""
        config = self.model.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2 * self._layers * heads * head_dim * self.model.dtype.itemsize

    def keep_finished(self, config: PrefixCacheConfig, room: Callable[[], int] | None = None) -> None:
        """Keeps released sessions' caches for new sessions that extend them (see PrefixCache), within
        `room()` bytes beside the live sessions when given (the KV budget's unreserved part)."""
        self.prefix_cache = PrefixCache(config, room=room)

    @property
    def cache_bytes(self) -> int:
        """Memory held by KV caches: live sessions' and kept ones'."""
        return self.live_cache_bytes + self.prefix_cache.bytes

    def adopt(
        self, key: str, token_ids: Sequence[int], owner: str = "", max_positions: int | None = None
    ) -> int:
        """Starts new session `key` of client `owner` from that client's kept cache that shares the
        longest prefix with `token_ids` (the positions it will prefill); returns how many positions it
        starts with (0: none kept). The session's cache holds at most `max_positions` positions of
        capacity (None: no limit), and the kept caches then give way to the reservations
        (PrefixCache.room). Raises ValueError when the key is live."""
        if key in self._caches:
            raise ValueError(f"session {key} is live")
        cache, n = self.prefix_cache.take(token_ids, owner)
        if cache is None:
            cache, n = SessionCache([GrowingLayer() for _ in range(self._layers)], owner=owner), 0
        self._caches[key] = cache
        self._cut(key, n)
        if max_positions is not None:
            for layer in cache.layers:
                layer.fit(max_positions)
        self.prefix_cache.fit()
        return n

    @property
    def live_cache_bytes(self) -> int:
        """Memory held by live sessions' KV caches, spare capacity included."""
        return sum(c.nbytes for c in self._caches.values())

    def forward(
        self, key: str, keep: int, token_ids: list[int], wants_logits: bool = True
    ) -> torch.Tensor | None:
        """Cuts session `key`'s cache to its first `keep` positions, runs `token_ids` after them and
        returns the logits of the new positions.  # [len(token_ids), vocab] float32 on CPU

        A new key starts an empty cache. Raises ValueError when keep exceeds the cached positions.
        """
        return self.forward_many([Forward(key, keep, tuple(token_ids), wants_logits)])[0]

    @torch.inference_mode()
    def forward_many(self, forwards: Sequence[Forward]) -> list[torch.Tensor | None]:
        """Runs the forwards of different sessions as one batch: ragged lengths, per-row positions,
        each session's own cache. Returns each one's logits as `forward` does.

        Raises ValueError when a key repeats or a keep exceeds its session's cached positions.
        """
        if len({f.key for f in forwards}) != len(forwards):
            raise ValueError("one forward per session in a batch")
        caches = [self._cut(f.key, f.keep) for f in forwards]
        live = [(f, c) for f, c in zip(forwards, caches, strict=True) if f.token_ids]
        by_key = dict(zip((f.key for f, _ in live), self._run(live), strict=True)) if live else {}
        empty = torch.empty(0, self.info.vocabulary.size)
        return [by_key.get(f.key, empty) if f.wants_logits else None for f in forwards]

    def _cut(self, key: str, keep: int) -> SessionCache:
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = SessionCache([GrowingLayer() for _ in range(self._layers)])
        if keep > cache.length:
            raise ValueError(f"session {key} holds {cache.length} positions, cannot keep {keep}")
        for layer in cache.layers:
            layer.cut(keep)
        del cache.tokens[keep:]
        return cache

    def _run(self, live: list[tuple[Forward, SessionCache]]) -> list[torch.Tensor | None]:
        # The rows packed into one sequence, each at its session's own positions, with no padding: the
        # projections and MLPs cost the batch's real positions, and a prefill chunk beside rounds adds
        # only its own. Attention reads each session's cache where it lies (rows_attention). Logits are
        # computed only for the rows that want them.
        widths = [len(f.token_ids) for f, _ in live]
        held = [c.length for _, c in live]
        ids = torch.tensor([t for f, _ in live for t in f.token_ids])
        positions = torch.cat([torch.arange(n) + start for n, start in zip(widths, held, strict=True)])
        starts = [0, *itertools.accumulate(widths)]
        wanted = [r for r, (f, _) in enumerate(live) if f.wants_logits]
        keep = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in wanted]) if wanted else 1
        try:
            out = self.model(
                input_ids=ids[None].to(self.device),
                position_ids=positions[None].to(self.device),
                past_key_values=RowsCache([c.layers for _, c in live], widths, self.attention),
                use_cache=True,
                logits_to_keep=keep,
            )
        except BaseException:
            # A failure part-way leaves some layers appended: put every row back as it was.
            for (_, c), length in zip(live, held, strict=True):
                for layer in c.layers:
                    layer.cut(length)
            raise
        for f, c in live:
            c.tokens += f.token_ids
        results: list[torch.Tensor | None] = [None] * len(live)
        if wanted:
            logits = out.logits[0, :, : self.info.vocabulary.size].float().cpu()
            for r, rows in zip(wanted, logits.split([widths[r] for r in wanted]), strict=True):
                results[r] = rows
        return results

    def release(self, key: str) -> None:
        """Ends session `key`: its cache is kept for a session that extends it if the prefix cache is on
        and has room, else freed; unknown keys are ignored."""
        cache = self._caches.pop(key, None)
        if cache is not None:
            self.prefix_cache.put(cache)


def load_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM in `model_dir` in `dtype`. A checkpoint of a narrower dtype served in float32 loads
    as views of its mapped file and is widened one weight at a time, each view's pages given back once
    copied (verifier_service/mapped.py): the file and the widened weights are never resident whole side
    by side (Qwen2.5-1.5B: a peak of 11.1 GB loaded straight in float32, for 7.1 GB of weights). Buffers
    stay as the model made them, which (inverse frequencies of rotary embeddings among them) it makes in
    float32 itself."""
    config = AutoConfig.from_pretrained(model_dir)
    stored = getattr(config.get_text_config(), "dtype", None) or getattr(config, "dtype", None)
    if dtype != torch.float32 or stored not in (torch.bfloat16, torch.float16, "bfloat16", "float16"):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    files = mapped.mapped_files()
    widened: dict[int, torch.nn.Parameter] = {}  # a tied weight widens once
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in widened:
                widened[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
                mapped.drop_pages(param, files)
            module._parameters[name] = widened[id(param)]
    return model


def model_name(model_dir: Path) -> str:
    """The name the target is served under (GetModelInfo.target_id, the edge's `model`): the pair's
    manifest's `name` (or the stem of the file it was made from, `SmolLM2-135M-Instruct`) where the
    directory sits in a pair written by `draftwire models`, else the directory's own name, with its
    parent's in front when that name is the pairs' generic `target` (`demo-target`)."""
    manifest = model_dir.parent / "manifest.json"
    try:
        record = json.loads(manifest.read_text(encoding="utf-8"))
        name = record.get("name") or Path(record["source"]["file"]).name.split(".")[0]
        if isinstance(name, str) and name.isprintable() and name:
            return name
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if model_dir.name == "target" and model_dir.parent.name:
        return f"{model_dir.parent.name}-target"
    return model_dir.name


def target_info(target_id: str, tokenizer, config) -> TargetInfo:
    """What the verifier tells edges about the target, read from its tokenizer and config."""
    vocabulary = vocabulary_from_hf(tokenizer, getattr(config, "vocab_size", None))
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return TargetInfo(
        target_id=target_id,
        vocabulary=vocabulary,
        max_context=families.context_limit(config),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        chat_template=tokenizer.chat_template or "",
    )
