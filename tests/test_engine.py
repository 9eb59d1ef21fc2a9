"""The target engine's caches: in-place growth, cut-back, and batches that equal one-at-a-time runs."""

import torch
from transformers import AutoModelForCausalLM

from verifier_service.engine import Forward, TargetEngine


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers without any cache: the logits of every position."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_cache_grows_and_cuts_back_like_no_cache(test_pair):
    """Rounds that grow the cache past its first capacity (64) and cut rejected positions back give
    the logits of a plain forward over the whole sequence."""
    engine = TargetEngine.load(test_pair.target_dir)
    model = AutoModelForCausalLM.from_pretrained(test_pair.target_dir, dtype=torch.float32).eval()
    sequence = list(range(5, 45))
    engine.forward("s", 0, sequence[:-1], logits=False)
    for step in range(14):  # each round: 5 new positions, 2 of them rejected and cut next time
        new = [(7 * step + i) % 200 + 3 for i in range(4)]
        logits = engine.forward("s", len(sequence) - 1, [sequence[-1], *new])
        expected = full_logits(model, sequence + new)[len(sequence) - 1 :]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        sequence += new[:2]
    assert len(sequence) > 64


def test_a_batch_equals_its_sessions_one_at_a_time(test_pair):
    """Ragged rounds of sessions with different cached lengths, batched and alone: the same logits,
    and the caches stay right for the next round."""
    batched = TargetEngine.load(test_pair.target_dir)
    alone = TargetEngine.load(test_pair.target_dir)
    prompts = {f"s{i}": list(range(3 + i, 3 + i + 10 + 9 * i)) for i in range(5)}
    for engine in (batched, alone):
        for key, ids in prompts.items():
            engine.forward(key, 0, ids, logits=False)
    for round_no in range(3):
        forwards = [
            Forward(key, len(ids) + round_no, tuple(range(11, 11 + 1 + (i + round_no) % 4)))
            for i, (key, ids) in enumerate(prompts.items())
        ]
        together = batched.forward_many(forwards)
        # Each round keeps one more position (the first new token) and cuts the rest back.
        for f, logits in zip(forwards, together, strict=True):
            expected = alone.forward(f.key, f.keep, list(f.token_ids))
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
