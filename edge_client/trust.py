"""What the edge checks of the verifier's GetModelInfo before using it. The answer comes from across the
network (from anyone in the middle, on a plaintext channel), so every field is checked against what the
device knows: the vocabulary must be the draft's (or the thin device's vocabulary file's), every special id
must lie in it, and the limits must be sane. A verifier that fails is refused at connect, with the reason.
"""

from __future__ import annotations

import unicodedata

from draftwire.contract import ModelInfo

MAX_CONTEXT = 1 << 24  # positions: far past any model's
MAX_GAMMA = 1024
MAX_EOS_IDS = 64
MAX_TEMPLATE_CHARS = 1 << 20
MAX_NAME_CHARS = 256


class UntrustedVerifier(Exception):
    """The verifier's ModelInfo does not hold up; the message says what and what the device expected."""


def check_model_info(info: ModelInfo, vocab_size: int | None) -> ModelInfo:
    """Returns `info` when it holds up against `vocab_size` (the device's vocabulary; None: unknown);
    raises UntrustedVerifier naming the first field that does not."""
    t = info.target
    size = t.vocabulary.size
    if vocab_size is not None and size != vocab_size:
        raise UntrustedVerifier(
            f"the verifier's vocabulary has {size} tokens, the device's {vocab_size}: "
            "the draft (or --vocab file) is not of the verifier's model family"
        )
    if not 0 < size < 1 << 31:
        raise UntrustedVerifier(f"the verifier's vocab_size {size} is out of range")
    if not 1 < t.max_context <= MAX_CONTEXT:
        raise UntrustedVerifier(f"the verifier's max_context {t.max_context} is out of range")
    for name, ids in (
        ("bos_token_id", () if t.bos_token_id is None else (t.bos_token_id,)),
        ("pad_token_id", () if t.pad_token_id is None else (t.pad_token_id,)),
        ("eos_token_ids", t.eos_token_ids),
    ):
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise UntrustedVerifier(f"the verifier's {name} {bad[0]} is outside its vocabulary of {size}")
    if len(t.eos_token_ids) > MAX_EOS_IDS:
        raise UntrustedVerifier(f"the verifier names {len(t.eos_token_ids)} end-of-sequence ids")
    if not 0 < info.max_gamma <= MAX_GAMMA:
        raise UntrustedVerifier(f"the verifier's max_gamma {info.max_gamma} is out of range")
    if not 1 << 10 <= info.max_message_bytes < 1 << 31:
        raise UntrustedVerifier(f"the verifier's max_message_bytes {info.max_message_bytes} is out of range")
    if len(t.chat_template) > MAX_TEMPLATE_CHARS:
        raise UntrustedVerifier(f"the verifier's chat template is {len(t.chat_template)} characters long")
    if not t.target_id or len(t.target_id) > MAX_NAME_CHARS or not all(_printable(c) for c in t.target_id):
        raise UntrustedVerifier(f"the verifier's target_id {t.target_id[:MAX_NAME_CHARS]!r} is not a name")
    return info


def _printable(c: str) -> bool:
    return c.isprintable() and unicodedata.category(c) not in ("Zl", "Zp")
