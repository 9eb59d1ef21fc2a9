"""Ctrl-C in a terminal goes to every process of its foreground group: the chat template's worker must
let the chat handle it (the reply stops, the chat goes on), however many times it comes."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[3]

# A chat's process in miniature: renders a turn per line read, and takes Ctrl-C as the chat does (its
# handler stops a reply; here it counts).
CHAT = textwrap.dedent(
    """
    import asyncio, signal, sys
    from edge_client.template import TemplateRenderer

    TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    interrupts = 0

    def interrupted(*_):
        global interrupts
        interrupts += 1

    async def main():
        signal.signal(signal.SIGINT, interrupted)
        renderer = TemplateRenderer()
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            pieces = await renderer.render(TEMPLATE, [{"role": "user", "content": line.strip()}], "", "")
            print("".join(p.text for p in pieces), interrupts, flush=True)
        renderer.close()

    asyncio.run(main())
    """
)


def test_the_template_worker_survives_ctrl_c_any_number_of_times():
    chat = subprocess.Popen(
        [sys.executable, "-c", CHAT],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job: Ctrl-C reaches all of it
    )
    try:
        for turn in range(3):
            chat.stdin.write(f"turn{turn}\n")
            chat.stdin.flush()
            assert chat.stdout.readline().split() == [f"<user>turn{turn}", str(turn)]
            os.killpg(chat.pid, signal.SIGINT)  # the worker is up (it rendered): Ctrl-C reaches both
        chat.stdin.write("after\n")
        chat.stdin.flush()
        assert chat.stdout.readline().split() == ["<user>after", "3"]
        chat.stdin.close()
        assert chat.wait(timeout=60) == 0
        stderr = chat.stderr.read()
        assert "KeyboardInterrupt" not in stderr and "Traceback" not in stderr, stderr
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
