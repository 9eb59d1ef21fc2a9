"""Ctrl-C in `draftwire chat`, as a terminal sends it (SIGINT to the whole foreground process group, the
chat template's worker included): each stops the reply under way, and the chat goes on, however many
come; no traceback, no BrokenProcessPool."""

import json
import os
import select
import shutil
import signal
import subprocess
import time

from tools.rig.serverproc import DRAFTWIRE, ServerProcess

TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


def read_until(chat: subprocess.Popen, text: str, timeout_s: float = 120) -> str:
    """The chat's output up to and including `text` (its prompts end without a newline)."""
    seen, deadline = "", time.monotonic() + timeout_s
    while text not in seen:
        ready, _, _ = select.select([chat.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {text!r} within {timeout_s} s: {seen!r}"
        chunk = os.read(chat.stdout.fileno(), 1 << 16).decode(errors="replace")
        assert chunk, f"the chat ended before {text!r}: {seen!r}"
        seen += chunk
    return seen


def test_a_chat_survives_any_number_of_ctrl_c(test_pair, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(test_pair.target_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with ServerProcess(target) as server:
        chat = subprocess.Popen(
            [DRAFTWIRE, "chat", "--server", server.address, "--draft", str(test_pair.draft_q4_0)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
        try:
            read_until(chat, "you> ")
            for turn in range(3):
                chat.stdin.write(f"def add{turn}(a, b):\n".encode())
                chat.stdin.flush()
                read_until(chat, "draftwire> ")
                os.killpg(chat.pid, signal.SIGINT)  # Ctrl-C: the chat and its template worker
                assert "[stopped]" in read_until(chat, "you> ") or turn  # a reply already done is fine
            chat.stdin.write(b"class Foo:\n")
            chat.stdin.flush()
            assert "tokens/s]" in read_until(chat, "you> ")  # a whole reply after the interrupts
            chat.stdin.write(b"\n")
            chat.stdin.flush()
            assert chat.wait(timeout=60) == 0
            stderr = chat.stderr.read().decode()
            assert "Traceback" not in stderr and "BrokenProcessPool" not in stderr, stderr
        finally:
            if chat.poll() is None:
                chat.kill()
                chat.wait()
