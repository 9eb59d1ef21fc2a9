"""The target engine's caches: in-place growth, cut-back, and batches that equal one-at-a-time runs."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from verifier_service.engine import Forward, TargetEngine


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers without any cache: the logits of every position."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_cache_grows_and_cuts_back_like_no_cache(test_pair):
    """Rounds that grow the cache past its first capacity (64) and cut rejected positions back give
    the logits of a plain forward over the whole sequence."""
    engine = TargetEngine.load(test_pair.target_dir, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(test_pair.target_dir, dtype=torch.float32).eval()
    sequence = list(range(5, 45))
    engine.forward("s", 0, sequence[:-1], wants_logits=False)
    for step in range(14):  # each round: 5 new positions, 2 of them rejected and cut next time
        new = [(7 * step + i) % 200 + 3 for i in range(4)]
        logits = engine.forward("s", len(sequence) - 1, [sequence[-1], *new])
        expected = full_logits(model, sequence + new)[len(sequence) - 1 :]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        sequence += new[:2]
    assert len(sequence) > 64


def test_a_batch_equals_its_sessions_one_at_a_time(test_pair):
    """Ragged prefills in one pass, then ragged rounds of sessions with different cached lengths (one
    of them starting from an empty cache), batched and alone: the same logits, and the caches stay
    right for the next round."""
    batched = TargetEngine.load(test_pair.target_dir, dtype="float32")
    alone = TargetEngine.load(test_pair.target_dir, dtype="float32")
    passes = []
    batched.model.register_forward_hook(lambda *_: passes.append(1))
    prompts = {f"s{i}": list(range(3 + i, 3 + i + 10 + 9 * i)) for i in range(5)}
    batched.forward_many([Forward(key, 0, tuple(ids), wants_logits=False) for key, ids in prompts.items()])
    assert len(passes) == 1
    for key, ids in prompts.items():
        alone.forward(key, 0, ids, wants_logits=False)
    prompts["fresh"] = []  # its first round runs on an empty cache
    for round_no in range(3):
        forwards = [
            Forward(key, len(ids) + round_no, tuple(range(11, 11 + 1 + (i + round_no) % 4)))
            for i, (key, ids) in enumerate(prompts.items())
        ]
        together = batched.forward_many(forwards)
        assert len(passes) == 2 + round_no
        # Each round keeps one more position (the first new token) and cuts the rest back.
        for f, logits in zip(forwards, together, strict=True):
            expected = alone.forward(f.key, f.keep, list(f.token_ids))
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_sliding_window_target_sees_only_its_window(test_pair, tmp_path):
    """A Mistral-style target whose window (6) is shorter than the sequence: batched rounds give the
    logits of transformers' own sliding-window forward over the whole sequence."""
    vocab = AutoModelForCausalLM.from_pretrained(test_pair.target_dir).config.vocab_size
    config = MistralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=6, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(test_pair.target_dir / name, tmp_path / name)
    engine = TargetEngine.load(tmp_path, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    sequences = {"a": list(range(5, 25)), "b": list(range(40, 51))}
    engine.forward_many(
        [Forward(key, 0, tuple(ids[:-1]), wants_logits=False) for key, ids in sequences.items()]
    )
    for step in range(3):
        new = {key: [(13 * step + i) % 97 + 3 for i in range(4)] for key in sequences}
        forwards = [Forward(key, len(ids) - 1, (ids[-1], *new[key])) for key, ids in sequences.items()]
        for f, logits in zip(forwards, engine.forward_many(forwards), strict=True):
            expected = full_logits(model, sequences[f.key] + new[f.key])[len(sequences[f.key]) - 1 :]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
            sequences[f.key] += new[f.key][:2]


def test_a_failed_batch_leaves_every_cache_as_it_was(test_pair):
    """A forward that fails after the first layer appended its keys: no session holds the failed
    positions, and the next rounds still give a plain forward's logits."""
    engine = TargetEngine.load(test_pair.target_dir, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(test_pair.target_dir, dtype=torch.float32).eval()
    sequences = {"a": list(range(5, 20)), "b": list(range(30, 38))}
    engine.forward_many(
        [Forward(key, 0, tuple(ids[:-1]), wants_logits=False) for key, ids in sequences.items()]
    )
    rounds = [Forward(key, len(ids) - 1, (ids[-1], 7, 8)) for key, ids in sequences.items()]

    def fail(*_):
        raise RuntimeError("device lost")

    hook = engine.model.model.layers[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.forward_many(rounds)
    hook.remove()
    with pytest.raises(ValueError, match="cannot keep"):  # as if the failed round had been cached
        engine.forward("a", len(sequences["a"]) + 2, [9])
    for f, logits in zip(rounds, engine.forward_many(rounds), strict=True):
        expected = full_logits(model, sequences[f.key] + [7, 8])[len(sequences[f.key]) - 1 :]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
