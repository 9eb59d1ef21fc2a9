"""The edge app's web page in headless Chromium (Debian's, driven by Playwright): send a message, watch the
verified reply stream in with its figures, stop a reply, reload and find the conversation kept.

Set DRAFTWIRE_SCREENSHOT=FILE to keep a screenshot of the page (docs/edge-app.png was taken so).
"""

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from tools.testkit.serverproc import DRAFTWIRE, ChildProcess, EdgeProcess, ServerProcess

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (install.sh installs it: apt-get install chromium)"
    db = tmp_path_factory.mktemp("edge") / "edge.sqlite3"
    with (
        ServerProcess(DEMO / "target") as verifier,
        EdgeProcess(verifier.address, DEMO / "draft-q8_0.gguf", db=db) as edge,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(edge.url)
        yield page
        browser.close()


def test_send_see_the_reply_stream_in_reload_and_find_it_kept(page):
    expect(page.locator("#model")).to_contain_text("verified remotely")
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")
    page.fill("#input", "Return the sum of a list.")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".figures")).to_contain_text("acceptance", timeout=60_000)
    expect(reply.locator(".figures")).to_contain_text("tokens/s")
    text = reply.locator(".text").inner_text()
    assert text.strip()
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#conversations li.active")).to_contain_text("Return the sum of a list.")

    # A second turn, then a reload: both turns are still there, with their figures.
    page.fill("#input", "Now the product.")
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant").nth(1).locator(".figures")).to_contain_text(
        "cached", timeout=60_000
    )
    page.reload()
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator(".msg.assistant").first.locator(".text")).to_have_text(text)
    expect(page.locator(".msg.assistant").first.locator(".figures")).to_contain_text("acceptance")
    if os.environ.get("DRAFTWIRE_SCREENSHOT"):
        page.screenshot(path=os.environ["DRAFTWIRE_SCREENSHOT"])


def test_the_stop_button_ends_a_reply_and_a_new_chat_starts_empty(page):
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    # Greedy, so the reply is the same every run: this one runs to the 900-token budget (a sampled reply
    # could meet EOS before the stop button is pressed, and the test would have nothing to stop).
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "900")
    page.fill("#input", "Write a parser for command line arguments.")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".text")).not_to_have_text("", timeout=60_000)
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    assert len(reply.locator(".text").inner_text()) < 900 * 2  # stopped well before its budget
    expect(reply.locator(".figures")).to_have_text("stopped")
    expect(page.locator("#conversations li")).to_have_count(2)
    # What was shown is kept, marked stopped, and the app answers the next message.
    # The app stores the stopped reply when it notices the disconnect, a moment after the click.
    figures = page.locator(".msg.assistant .figures")
    deadline = time.monotonic() + 30
    while True:
        page.reload()
        page.wait_for_selector("#conversations li")
        if figures.count() and "stopped" in figures.last.inner_text() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    expect(figures.last).to_contain_text("stopped")
    page.fill("#max-tokens", "8")
    page.fill("#input", "Shorter, please.")
    page.click("#send")
    expect(page.locator(".msg.assistant").last.locator(".figures")).to_contain_text(
        "acceptance", timeout=60_000
    )


def test_demo_web_starts_a_verifier_and_the_edge_app(tmp_path):
    argv = [DRAFTWIRE, "demo", "--web", "--models", str(DEMO), "--port", "0"]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    with ChildProcess(argv, r"open (http://\S+/)", env=env) as demo:
        with urllib.request.urlopen(demo.found + "v1/models", timeout=30) as response:
            assert json.loads(response.read())["data"][0]["meta"]["draft"] == "draft-q8_0.gguf"
        with urllib.request.urlopen(demo.found, timeout=30) as response:
            assert b'id="composer"' in response.read()
    assert (
        tmp_path / "draftwire" / "edge.sqlite3"
    ).is_file()  # conversations go to the user's data directory
