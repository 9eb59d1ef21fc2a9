"""The references the exactness tests compare with: transformers' own greedy `generate` on the target, in
float32, with nothing of the verifier's (no engine, no rules, no caches of ours); and `reference` (the
target alone, one position per forward) cached on disk by everything its tokens depend on."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path


def transformers_greedy(
    target: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy continuation by transformers' `generate` in float32: up to `max_new_tokens`,
    the end of sequence included where it comes first (as a session stops there). Read from the cache
    where the same key was generated before (the model's bytes, the CPU's plain float32 kernel class,
    the libraries, this file, the prompt and the length), else generated and written there."""
    from verifier_service.numerics import Hardware

    kernels = Hardware.detect("cpu").numerics("float32", exact=False).identity
    common = {**_common_key(target), "oracle": "transformers-greedy", "kernels": kernels}
    common["code"] = _code(ORACLE_CODE)
    keys = [{**common, "prompt": list(p), "max_new_tokens": max_new_tokens} for p in prompts]
    found = [_load(key) for key in keys]
    missing = [i for i, ids in enumerate(found) if ids is None]
    if missing:
        fresh = _generate_greedy(target, [prompts[i] for i in missing], max_new_tokens)
        for i, ids in zip(missing, fresh, strict=True):
            _store(keys[i], ids)
            found[i] = ids
    return found


def transformers_constrained_greedy(
    target: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, constraint
) -> list[list[int]]:
    """Each prompt's greedy continuation by transformers' `generate` in float32 under llguidance's mask of
    `constraint`, built from transformers' tokenizer (nothing of ours: no engine, no rules, no matcher):
    up to `max_new_tokens`, the end of sequence included where it comes first. Not cached."""
    return _generate_greedy(target, prompts, max_new_tokens, constraint)


def _generate_greedy(
    target: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, constraint=None
) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt, under llguidance's mask of `constraint` where one
    is given (guidance_mask; stopping at the model's end-of-sequence ids, as a session does); the model
    is freed before returning."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    constrained = {}
    if constraint is not None:
        tokenizer = AutoTokenizer.from_pretrained(target)
        eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        eos = list(eos) if isinstance(eos, list) else [eos]
        constrained = {"pad_token_id": eos[0], "eos_token_id": eos}
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            if constraint is not None:  # a fresh matcher for each prompt
                mask = guidance_mask(tokenizer, constraint, constrained["eos_token_id"])
                constrained["logits_processor"] = LogitsProcessorList([mask])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                **{"pad_token_id": pad, **constrained},
            )
            outputs.append(out[0, len(prompt) :].tolist())
    del model
    gc.collect()
    return outputs


# The code a reference's tokens depend on besides the model and the spec: a change to any of these
# files is a new key, so a cached reference is never older than the code it stands for.
REFERENCE_CODE = (
    "draftwire/contract.py",
    "draftwire/ngram.py",
    "draftwire/rules.py",
    "verifier_service/attention.py",
    "verifier_service/attention_checks.py",
    "verifier_service/batcher.py",
    "verifier_service/engine.py",
    "verifier_service/families.py",
    "verifier_service/invariant.py",
    "verifier_service/kv.py",
    "verifier_service/numerics.py",
    "verifier_service/session.py",
)
ROOT = Path(__file__).resolve().parents[2]


def reference_cache_dir() -> Path:
    """Where cached references live: $DRAFTWIRE_REFERENCE_CACHE, else ~/.cache/draftwire/references
    (outside the checkout, so that CI's fresh clones on one machine share it, as they share the fetched
    models)."""
    if os.environ.get("DRAFTWIRE_REFERENCE_CACHE"):
        return Path(os.environ["DRAFTWIRE_REFERENCE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "draftwire" / "references"


_model_digests: dict[tuple, str] = {}


def model_digest(target: Path) -> str:
    """sha256 over the target directory's files (names and contents), memoized while no file changes."""
    import hashlib

    files = sorted(p for p in Path(target).rglob("*") if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stamp not in _model_digests:
        digest = hashlib.sha256()
        for path in files:
            digest.update(str(path.relative_to(target)).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
        _model_digests[stamp] = digest.hexdigest()
    return _model_digests[stamp]


ORACLE_CODE = ("tools/testkit/oracle.py",)


def _code(files: Sequence[str]) -> str:
    import hashlib

    return hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in files)).hexdigest()


def _common_key(target: Path) -> dict:
    from importlib.metadata import version

    return {"model": model_digest(target), "torch": version("torch"), "transformers": version("transformers")}


def reference_key(target: Path, engine, spec) -> dict:
    """What a reference's tokens are a function of: the model's bytes, the numerics the engine computes
    with (dtype, kernel class, device), the libraries, the code (REFERENCE_CODE) and the spec."""
    return {
        **_common_key(target),
        "numerics": engine.numerics.identity,
        "code": _code(REFERENCE_CODE),
        "spec": repr(spec),
    }


def _path(key: dict) -> Path:
    import hashlib
    import json

    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return reference_cache_dir() / f"{name}.json"


def _load(key: dict) -> list[int] | None:
    """The cached ids of `key`; None when absent, damaged or another key's."""
    import json

    try:
        cached = json.loads(_path(key).read_text())
        return cached["ids"] if cached["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(key: dict, ids: list[int]) -> None:
    import json

    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_suffix(f".{os.getpid()}.tmp")
    fresh.write_text(json.dumps({"key": key, "ids": ids}))
    fresh.replace(path)


def cached_references(target: Path, engine, specs: Sequence) -> list[list[int]]:
    """`reference_decode(engine, spec)` for each spec (the target alone, one position per forward), read
    from the cache where the same key (reference_key) was decoded before, else decoded and written
    there. `engine` must be the target at `target`, loaded as the key says."""
    from verifier_service.session import reference_decode

    out = []
    for spec in specs:
        key = reference_key(target, engine, spec)
        ids = _load(key)
        if ids is None:
            ids = reference_decode(engine, spec)
            _store(key, ids)
        out.append(ids)
    return out


def guidance_mask(tokenizer, constraint, eos: list[int]):
    """A transformers logits processor that applies llguidance's mask of `constraint`, built from
    transformers' tokenizer (nothing of ours: no matcher, no rules): the independent oracle of
    structured output under `generate`."""
    return _guidance_mask_class()(tokenizer, constraint, eos)


@functools.cache
def _guidance_mask_class():
    import json

    import llguidance
    import llguidance.hf
    import numpy as np
    import torch
    from transformers import LogitsProcessor

    from draftwire.contract import Constraint, ConstraintKind
    from draftwire.grammar import JSON_OPTIONS

    class GuidanceMask(LogitsProcessor):
        """llguidance's mask on transformers' scores, from transformers' tokenizer: the independent oracle."""

        def __init__(self, tokenizer, constraint: Constraint, eos: list[int]):
            lltokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
            if constraint.kind is ConstraintKind.JSON_OBJECT:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, overrides=JSON_OPTIONS
                )
            elif constraint.kind is ConstraintKind.JSON_SCHEMA:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.loads(constraint.source), overrides=JSON_OPTIONS
                )
            elif constraint.kind is ConstraintKind.GRAMMAR:
                grammar = llguidance.LLMatcher.grammar_from_lark(constraint.source)
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(constraint.source)
            self.matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
            self.prompt_length: int | None = None

        def __call__(self, input_ids, scores):
            if self.prompt_length is None:
                self.prompt_length = input_ids.shape[1]
            elif input_ids.shape[1] > self.prompt_length:
                assert self.matcher.consume_token(int(input_ids[0, -1]))
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
            allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
            width = min(len(bits), scores.shape[-1])
            allowed[:width] = torch.from_numpy(bits[:width].astype(bool))
            return scores.masked_fill(~allowed, float("-inf"))

    return GuidanceMask
