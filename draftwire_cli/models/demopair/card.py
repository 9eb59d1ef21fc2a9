"""The model card: figures measured on held-out files, written next to the models as JSON and markdown."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import grpc
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftwire_cli.models.demopair.corpus import WINDOW, corpus_files, heldout_windows
from draftwire_cli.models.demopair.files import PairFiles
from edge_client.llama_runtime import Llama

GGUF_KINDS = ("f16", "q8_0", "q4_0")
STALENESS_POSITIONS = 512  # the card's agreement over the first windows, which a test recomputes


def load_target(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def target_argmax_and_loss(target, windows: list[list[int]]) -> tuple[list[torch.Tensor], float]:
    """Per window the target's argmax at each position, and the mean next-token loss."""
    argmaxes, losses = [], []
    with torch.inference_mode():
        for w in windows:
            logits = target(input_ids=torch.tensor([w])).logits[0]
            argmaxes.append(logits.argmax(-1))
            losses.append(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(w[1:])).item())
    return argmaxes, float(np.mean(losses))


def gguf_agreement(path: Path, windows: list[list[int]], target_argmax: list[torch.Tensor]) -> float:
    """Teacher-forced: the share of positions where the GGUF draft's argmax equals the target's."""
    llm = Llama(model_path=str(path), n_ctx=WINDOW, logits_all=True, verbose=False)
    hits = total = 0
    for w, want in zip(windows, target_argmax, strict=True):
        llm.reset()
        llm.eval(w)
        got = torch.from_numpy(np.asarray(llm.scores[: len(w)])).argmax(-1)
        hits += int((got == want).sum())
        total += len(w)
    llm.close()
    return hits / total


def distinct_4gram_ratio(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


async def speculative_run(
    target_dir: Path, draft: Path, prompts: list[list[int]], temperature: float
) -> dict:
    """The project's own server and client on loopback at gamma 4: acceptance and repetition."""
    from draftwire.contract import SamplingParams
    from edge_client.drafter import DrafterConfig, LlamaDrafter
    from edge_client.session import EdgeSession, GenerationRequest
    from verifier_service.engine import TargetEngine
    from verifier_service.servicer import ServerConfig, start_server

    server, port = await start_server(TargetEngine.load(target_dir), ServerConfig(port=0))
    try:
        drafter = LlamaDrafter(DrafterConfig(draft))
        accepted = proposed = tokens = rounds = 0
        ratios = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            session = EdgeSession(channel, drafter)
            for i, prompt in enumerate(prompts):
                params = SamplingParams(temperature=temperature, seed=i) if temperature else SamplingParams()
                ids, stats = await session.run(GenerationRequest(tuple(prompt), params, 64, gamma=4))
                accepted += stats.accepted_tokens
                proposed += stats.draft_tokens
                tokens += len(ids)
                rounds += stats.rounds
                ratios.append(distinct_4gram_ratio(ids))
    finally:
        await server.stop(grace=1.0)
    return {
        "prompts": len(prompts),
        "acceptance_rate": accepted / proposed,
        "tokens_per_round": tokens / rounds,
        "mean_distinct_4gram_ratio": float(np.mean(ratios)),
        "share_in_repetition_loops": float(np.mean([r < 0.5 for r in ratios])),
    }


def measure(root: Path, quick: bool = False) -> dict:

    files = PairFiles(root)
    tokenizer = AutoTokenizer.from_pretrained(files.target)
    target = load_target(files.target)
    windows = heldout_windows(tokenizer, 8 if quick else 64)
    argmax, loss = target_argmax_and_loss(target, windows)
    first = STALENESS_POSITIONS // WINDOW
    figures: dict = {
        "heldout": {"files": len(corpus_files(heldout=True)), "positions": sum(map(len, windows))},
        "target_heldout_loss": loss,
        "target_heldout_perplexity": math.exp(loss),
        "teacher_forced_agreement": {
            kind: gguf_agreement(files.gguf(kind), windows, argmax) for kind in GGUF_KINDS
        },
        "teacher_forced_agreement_first_512": {
            kind: gguf_agreement(files.gguf(kind), windows[:first], argmax[:first]) for kind in GGUF_KINDS
        },
    }
    prompts = [w[:48] for w in heldout_windows(tokenizer, 6 if quick else 50, length=WINDOW)]
    figures["speculative_gamma4"] = {
        kind: {
            mode: asyncio.run(speculative_run(files.target, files.gguf(kind), prompts, t))
            for mode, t in (("greedy", 0.0), ("temperature_0.8", 0.8))
        }
        for kind in ("q8_0", "q4_0")
    }
    figures["file_bytes"] = {
        str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
    }
    figures["total_bytes"] = sum(figures["file_bytes"].values())
    return figures


def _build_lines(b: dict) -> list[str]:
    """The card's head: what was trained, how large, how long."""
    return [
        "# draftwire demo pair",
        "",
        "A Llama-architecture target and a distilled draft, trained by `draftwire models build` on the",
        "standard library of the interpreter that ran it; every figure below is measured on held-out files",
        "(one in twenty, chosen by a hash of the path) that neither model was trained on.",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| parameters | {b['target']['parameters']:,} | {b['draft']['parameters']:,} |",
        f"| multiply-adds per token | {b['target']['compute_per_token']:,} "
        f"| {b['draft']['compute_per_token']:,} |",
        f"| training steps | {b['target']['training']['steps']} | {b['draft']['training']['steps']} |",
        f"| training time | {b['target']['training']['seconds'] / 60:.1f} min "
        f"| {b['draft']['training']['seconds'] / 60:.1f} min |",
        "",
        f"Draft-to-target compute per token: **{b['draft']['to_target_compute']:.3f}**. "
        f"Whole build: {(b['target']['seconds'] + b['draft']['seconds']) / 60:.1f} min plus the card, "
        f"on {b['machine']['cpus']} CPU threads "
        f"({b['machine']['processor']}, torch {b['machine']['torch']}).",
    ]


def markdown(card: dict) -> str:
    b, e = card["build"], card["evaluation"]
    mb = 1 / 1e6
    lines = [
        *_build_lines(b),
        "",
        f"Target held-out loss **{e['target_heldout_loss']:.3f}** nats/token, perplexity "
        f"**{e['target_heldout_perplexity']:.1f}** ({e['heldout']['positions']} positions, "
        f"{e['heldout']['files']} files).",
        "",
        "Teacher-forced agreement (draft argmax equals target argmax on held-out text):",
        "",
        "| GGUF | agreement | size (MB) |",
        "|---|---|---|",
    ]
    for kind, value in e["teacher_forced_agreement"].items():
        size = e["file_bytes"].get(f"draft-{kind}.gguf", 0) * mb
        lines.append(f"| {kind} | {value:.3f} | {size:.2f} |")
    lines += [
        "",
        "A real speculative run (`draftwire`'s own server and client on loopback), gamma 4, "
        f"{e['speculative_gamma4']['q8_0']['greedy']['prompts']} held-out prompts of 48 tokens, "
        "64 new tokens:",
        "",
        "| draft | mode | acceptance | tokens/round | distinct 4-grams | outputs in loops |",
        "|---|---|---|---|---|---|",
    ]
    for kind, modes in e["speculative_gamma4"].items():
        for mode, r in modes.items():
            lines.append(
                f"| {kind} | {mode} | {r['acceptance_rate']:.3f} | {r['tokens_per_round']:.2f} "
                f"| {r['mean_distinct_4gram_ratio']:.3f} | {r['share_in_repetition_loops']:.0%} |"
            )
    lines += [
        "",
        "An output is in a loop when fewer than half of its 4-grams are distinct.",
        "",
        f"Files: {e['total_bytes'] * mb:.1f} MB in all.",
        "",
        "| file | bytes |",
        "|---|---|",
        *(f"| {name} | {size:,} |" for name, size in e["file_bytes"].items()),
    ]
    return "\n".join(lines) + "\n"


def write_card(files, log, quick: bool = False) -> None:
    card = json.loads(files.card_json.read_text())
    log("measuring the card's figures on held-out files")
    card["evaluation"] = measure(files.root, quick=quick)
    files.card_json.write_text(json.dumps(card, indent=2) + "\n")
    (files.root / "model_card.md").write_text(markdown(card))
    log(f"card written: {files.root / 'model_card.md'}")
