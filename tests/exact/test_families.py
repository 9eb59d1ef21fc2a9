"""The family matrix: a tiny random model of every family in verifier_service/families.py, served by the
real engine behind a real grpc.aio server on loopback, drafted by real llama.cpp.

- a family served exactly loads in bit-exact mode (the conformance and invariance checks at load pass,
  sliding windows and soft-capping included); its greedy output equals transformers' own `generate`
  in float32, drafted by llama.cpp and by the verifier's prompt lookup; its seeded output equals
  `reference`;
- a family served only plainly fails the invariance check and loads with --no-bit-exact;
- a refused family is refused at load, and would be by the checks alone without its line in the table.

docs/families.md is rendered from the table: `python -m tests.exact.test_families --write-docs`.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
import transformers as T
from transformers import AutoModelForCausalLM

from draftwire.contract import Drafting, SamplingParams, SessionSpec
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import DRAFTWIRE
from tools.testkit.fakes import ScriptedDrafter
from verifier_service import families
from verifier_service.engine import NoExactPath, TargetEngine, UnsupportedModel
from verifier_service.servicer import ServerConfig, VerifierLimits, start_server
from verifier_service.session import reference_decode

DOC = Path(__file__).resolve().parents[2] / "docs" / "families.md"
NEW = 16
_SMALL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
_WINDOW = dict(sliding_window=6)  # shorter than the prompts, so that the window matters
_GPT = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# A tiny config per family (and per RoPE variant): (config class, its arguments beside _SMALL's).
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama-rope-llama3": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            )
        ),
    ),  # fmt: skip
    "mistral": ("MistralConfig", _WINDOW),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-rope-yarn": (
        "Qwen2Config",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_WINDOW),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **_WINDOW,
        ),
    ),  # fmt: skip
    "gemma3n_text": (
        "Gemma3nTextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            laurel_rank=8,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=512,
            num_kv_shared_layers=2,
            altup_num_inputs=2,
            intermediate_size=[128] * 4,
            activation_sparsity_pattern=[0.0] * 4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            **_WINDOW,
        ),
    ),  # fmt: skip
    "phi3": ("Phi3Config", {}),
    "phi3-rope-longrope": (
        "Phi3Config",
        dict(
            original_max_position_embeddings=64,
            rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8),
        ),
    ),  # fmt: skip
    "phi": ("PhiConfig", {}),
    "gpt2": ("GPT2Config", _GPT),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "starcoder2": ("Starcoder2Config", _WINDOW),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", _WINDOW),
    "granite": (
        "GraniteConfig",
        dict(embedding_multiplier=2.0, logits_scaling=3.0, attention_multiplier=0.2),
    ),  # fmt: skip
    "cohere": ("CohereConfig", {}),
    "cohere2": ("Cohere2Config", _WINDOW),
    "stablelm": ("StableLmConfig", {}),
    "smollm3": ("SmolLM3Config", {}),
    "exaone4": ("Exaone4Config", _WINDOW),
    "glm4": ("Glm4Config", dict(head_dim=16)),
    "lfm2": ("Lfm2Config", {}),
    "apertus": ("ApertusConfig", {}),
    "seed_oss": ("SeedOssConfig", dict(head_dim=16)),
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=16)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, **_EXPERTS)),
    "falcon": ("FalconConfig", dict(num_kv_heads=2, new_decoder_architecture=True)),
    "gptj": ("GPTJConfig", dict(rotary_dim=8, **_GPT)),
    "opt": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4)),
    "llama4_text": (
        "Llama4TextConfig",
        dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128, attention_chunk_size=6),
    ),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **_WINDOW)),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            head_dim=16,
            shared_expert_intermediate_size=32,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            **_EXPERTS,
        ),
    ),  # fmt: skip
    "mamba": ("MambaConfig", {}),
}


def family_of(variant: str) -> str:
    return variant.split("-")[0]


def by_state(state: str) -> list[str]:
    return [v for v in CONFIGS if families.FAMILIES[family_of(v)].state == state]


def build(variant: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Writes a tiny random model of the variant, with the test pair's tokenizer, to out_dir."""
    name, extra = CONFIGS[variant]
    config = getattr(T, name)(**{**({} if "n_embd" in extra else _SMALL), **extra})
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / file, out_dir / file)
    return out_dir


@pytest.fixture(scope="module")
def prompts(test_pair) -> list[tuple[int, ...]]:
    """Two prompts longer than the sliding windows; one repeats itself, so prompt lookup drafts."""
    tokenizer = T.AutoTokenizer.from_pretrained(test_pair.target_dir)
    code = "def read_config(path):\n    with open(path) as f:\n        return f.read()\n"
    text = tokenizer(code)["input_ids"]
    return [tuple(text[:20]), tuple(text[:6] * 3)]


@pytest.fixture(scope="module")
def drafter(test_pair) -> LlamaDrafter:
    return LlamaDrafter(DrafterConfig(test_pair.draft_f16, n_ctx=256))


def speculate(engine: TargetEngine, runs: list[tuple[object, list[GenerationRequest]]]) -> list[list]:
    """Each run's requests, all at once (batched), through a real grpc.aio server on loopback, with the
    run's drafter (None: a thin session, drafted by the verifier); each run's [(ids, stats)]."""

    async def run():
        server, port = await start_server(engine, ServerConfig(port=0, limits=VerifierLimits(max_gamma=8)))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                sessions = [EdgeSession(channel, drafter) for drafter, _ in runs]
                pairs = zip(sessions, runs, strict=True)
                results = await asyncio.gather(*(asyncio.gather(*map(s.run, rs)) for s, (_, rs) in pairs))
                return [list(result) for result in results]
        finally:
            await server.stop(None)

    return asyncio.run(run())


@pytest.mark.parametrize("variant", by_state(families.EXACT))
def test_a_family_served_exactly(variant, test_pair, prompts, drafter, tmp_path):
    model_dir = build(variant, test_pair.target_dir, tmp_path)
    engine = TargetEngine.load(model_dir, dtype="float32")  # proves conformance and invariance at load
    assert engine.numerics.exact and engine.info.target_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        expected.append(out[0, len(prompt) :].tolist())
    seeded = SamplingParams(0.9, top_p=0.95, seed=7)
    alone = [reference_decode(engine, SessionSpec(p, seeded, NEW)) for p in prompts]
    # llama.cpp's draft (of another model: mostly refused), the verifier's prompt lookup, and drafts of
    # the expected output with a mistake every fifth token (accepted whole, in part and not at all).
    scripted = ScriptedDrafter(dict(zip(prompts, expected, strict=True)), drafter)
    sampled_script = ScriptedDrafter(dict(zip(prompts, alone, strict=True)), drafter)
    first, second = prompts
    runs = [
        (drafter, [GenerationRequest(p, max_new_tokens=NEW, gamma=4) for p in prompts]),
        (None, [GenerationRequest(p, max_new_tokens=NEW, gamma=8, drafting=Drafting.NGRAM) for p in prompts]),
        (
            scripted,
            [
                GenerationRequest(first, max_new_tokens=NEW, gamma=3),
                GenerationRequest(second, max_new_tokens=NEW, gamma=8),
            ],
        ),
        (drafter, [GenerationRequest(p, seeded, NEW, gamma=3) for p in prompts]),
        (
            sampled_script,
            [GenerationRequest(first, seeded, NEW, gamma=4), GenerationRequest(second, seeded, NEW, gamma=6)],
        ),
    ]
    results = speculate(engine, runs)
    outputs = [[ids for ids, _ in result] for result in results]
    assert outputs[:3] == [expected] * 3
    assert outputs[3:] == [alone] * 2
    for result in (results[2], results[4]):  # the scripted drafts: some accepted, some refused
        accepted = sum(stats.accepted_tokens for _, stats in result)
        assert 0 < accepted < sum(stats.draft_tokens for _, stats in result)


def test_a_longrope_target_is_served_up_to_its_original_context(test_pair, tmp_path):
    """Past its original context, longrope switches every position's frequencies by the longest
    position in the forward: a row's logits would follow its batch company."""
    engine = TargetEngine.load(build("phi3-rope-longrope", test_pair.target_dir, tmp_path), dtype="float32")
    assert engine.info.max_context == 64


@pytest.mark.parametrize("variant", by_state(families.PLAIN))
def test_a_family_served_only_plainly(variant, test_pair, tmp_path):
    model_dir = build(variant, test_pair.target_dir, tmp_path)
    with pytest.raises(NoExactPath, match="no dtype is bit-exact"):
        TargetEngine.load(model_dir, dtype="float32")
    engine = TargetEngine.load(model_dir, dtype="float32", invariant=False)  # conformance still checked
    assert not engine.numerics.exact


@pytest.mark.parametrize("variant", by_state(families.REFUSED))
def test_a_refused_family_is_refused_at_load_and_would_be_by_the_checks(
    variant, test_pair, tmp_path, monkeypatch
):
    model_dir = build(variant, test_pair.target_dir, tmp_path)
    family = families.FAMILIES[family_of(variant)]
    with pytest.raises(UnsupportedModel, match=re.escape(family.name)):
        TargetEngine.load(model_dir, dtype="float32")
    monkeypatch.delitem(families.FAMILIES, family_of(variant))  # unlisted: only the checks at load
    with pytest.raises((UnsupportedModel, NoExactPath)):
        TargetEngine.load(model_dir, dtype="float32", invariant=False)


def test_serve_refuses_a_family_in_one_line(test_pair, tmp_path):
    model_dir = build("gpt_oss", test_pair.target_dir, tmp_path)
    argv = [DRAFTWIRE, "serve", "--target", str(model_dir), "--port", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"--target {model_dir}: the verifier cannot serve gpt-oss (gpt_oss) models" in out.stderr


def test_every_family_in_the_table_is_in_the_matrix():
    assert set(families.FAMILIES) == {family_of(v) for v in CONFIGS}


_DOC_HEAD = """\
# Model families the verifier serves

Generated from `verifier_service/families.py` by `python -m tests.exact.test_families --write-docs`;
every row is checked by `tests/exact/test_families.py` on a tiny random model of the family
(transformers {version}, float32 on CPU).

- **bit-exact**: loads in bit-exact mode; greedy output equals transformers' own `generate`,
  and seeded output equals `reference`, through a real server, drafted by llama.cpp, by the
  verifier's prompt lookup, and by drafts of the expected output with every fifth token wrong.
  Sliding windows are shorter than the prompts; Gemma 2/3 soft-cap their attention scores.
- **served only with `--no-bit-exact`**: its forward is reproduced, but not bit for bit
  whatever shares the batch; the bit-exact default refuses it at load.
- **refused at load**, with the reason as the message. Without its row, the checks at load
  (the engine against the model's own forward, then invariance) refuse it too.

A family not in the table is loaded and then proven or refused by those same checks:
`TargetEngine.check_conformance` compares a prefill and two rounds through the verifier's
caches with the model's own forward (float32: within 1e-4 of the logits' range), and
`check_invariance` compares one position at a time with a γ + 1 round and a batch, bit for bit.

Real pretrained pairs, exact end to end through `serve` (greedy against transformers' `generate` in
float32, seeded against `reference`):

- `llama`: SmolLM2-135M-Instruct drafting for itself from its shipped and requantized GGUFs
  (`tests/exact/test_real_pair.py`, 20 chat prompts × 128 tokens).
- `qwen2`: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B (`tests/exact/test_qwen_pair.py`, through
  the Ray pool too; `draftwire models fetch qwen2.5-coder`).
- `gemma3_text`: Gemma 3 270M drafting for itself from its Q4_K_M file, a SentencePiece vocabulary
  of 262,144 tokens, γ 4 and 8, one prompt longer than its 512-position sliding window
  (`tests/exact/test_gemma_pair.py`; `draftwire models fetch gemma-3-270m`).

| Family | `model_type` | State | What the matrix checks, or why |
|---|---|---|---|
"""


def render() -> str:
    """docs/families.md from the table."""
    words = {
        families.EXACT: "bit-exact",
        families.PLAIN: "served only with `--no-bit-exact`",
        families.REFUSED: "refused at load",
    }
    rows = [
        f"| {f.name} | `{model_type}` | {words[f.state]} | {f.note} |\n"
        for state in words
        for model_type, f in families.FAMILIES.items()
        if f.state == state
    ]
    return _DOC_HEAD.format(version=T.__version__) + "".join(rows)


def test_the_families_doc_is_rendered_from_the_table():
    rerun = "run: python -m tests.exact.test_families --write-docs"
    assert DOC.read_text(encoding="utf-8") == render(), rerun


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        DOC.write_text(render(), encoding="utf-8")
        print(f"wrote {DOC}")
