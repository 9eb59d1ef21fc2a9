"""The chat app: template rendering against transformers, streaming over a real server, the CLI."""

import asyncio
import io
import json
import shutil
import subprocess

import grpc
import pytest
from transformers import AutoTokenizer

from edge_client.chat import ChatConfig, chat, chat_prompt, render_chat, reply
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession
from tools.rig.serverproc import DRAFTWIRE, ServerProcess

TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Now one that subtracts."},
]


@pytest.fixture(scope="module")
def templated_target(test_pair, tmp_path_factory):
    """The test target with a chat template in its tokenizer config."""
    target = tmp_path_factory.mktemp("templated") / "target"
    shutil.copytree(test_pair.target_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def drafter(test_pair):
    return LlamaDrafter(DrafterConfig(test_pair.draft_f16, n_ctx=512))


def test_render_chat_matches_transformers(templated_target):
    tokenizer = AutoTokenizer.from_pretrained(templated_target)
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert render_chat(TEMPLATE, MESSAGES, tokenizer.bos_token, tokenizer.eos_token) == expected


def test_chat_over_the_wire_uses_the_targets_template(templated_target, drafter):
    tokenizer = AutoTokenizer.from_pretrained(templated_target)
    expected_ids = tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    server = ServerProcess(templated_target)
    try:

        async def run():
            async with grpc.aio.insecure_channel(server.address) as channel:
                session = EdgeSession(channel, drafter)
                info = await session.model_info()
                out = io.StringIO()
                await chat(session, ChatConfig(max_new_tokens=12), out, once="hello")
                return info, out.getvalue()

        info, transcript = asyncio.run(run())
    finally:
        server.stop()
    assert info.target.chat_template == TEMPLATE
    assert chat_prompt(info, drafter, MESSAGES) == list(expected_ids)
    assert "(chat template)" in transcript
    assert "draftwire> " in transcript and "tokens/s]" in transcript


class RecordingOut(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def test_reply_streams_round_by_round(server, drafter):
    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            out = RecordingOut()
            text, stats = await reply(
                EdgeSession(channel, drafter),
                [{"role": "user", "content": "def add(a, b):"}],
                ChatConfig(4, 30),
                out,
            )
            return out, text, stats

    out, text, stats = asyncio.run(run())
    assert stats.rounds > 1
    # One write per round that committed printable text, plus the closing newline.
    assert len([w for w in out.writes if w]) > 2
    assert out.getvalue() == text + "\n"


def test_cli_chat_reads_turns_from_stdin(server, test_pair):
    proc = subprocess.run(
        [
            DRAFTWIRE,
            "chat",
            "--server",
            server.address,
            "--draft",
            str(test_pair.draft_q4_0),
            "--max-new-tokens",
            "10",
        ],
        input="def add(a, b):\nclass Foo:\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("draftwire> ") == 2
    assert proc.stdout.count("tokens/s]") == 2
    assert "plain completion" in proc.stdout
