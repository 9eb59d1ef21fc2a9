"""The edge app's web page in headless Chromium (Debian's, driven by Playwright): send a message, watch the
verified reply stream in with its figures, stop a reply, reload and find the conversation kept.

Set DRAFTWIRE_SCREENSHOT=FILE to keep a screenshot of the page (docs/runs/edge-app.png was taken so).
"""

import contextlib
import http.server
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from tools.rig.serverproc import DRAFTWIRE, ChildProcess, EdgeProcess, ServerProcess

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


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
        page.db = db
        yield page
        browser.close()


def ask(page, text: str, max_tokens: int):
    """Sends `text` greedily and waits for the reply's figures; returns the reply's element."""
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#input", text)
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".figures")).to_contain_text("acceptance", timeout=60_000)
    return reply


def test_send_see_the_reply_stream_in_reload_and_find_it_kept(page):
    expect(page.locator("#model")).to_contain_text("verified remotely")
    reply = ask(page, "Return the sum of a list.", 24)
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
    expect(page.locator(".msg.assistant").first.locator(".text")).to_have_text(text, use_inner_text=True)
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
    shown = reply.evaluate("e => e.source")  # the reply's text (markdown) as shown when Stop was pressed
    assert shown and len(shown) < 900 * 2  # stopped well before its budget
    # The stopped reply's figures, once the edge has stored it: its tokens and rate, marked stopped.
    expect(reply.locator(".figures")).to_contain_text("stopped")
    expect(reply.locator(".figures")).to_contain_text("tokens/s", timeout=30_000)
    expect(reply.locator(".figures")).to_contain_text("acceptance")
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
    # Stored exactly as it was shown (the page reads the store: SQLite), not the text the edge sent on.
    assert page.locator(".msg.assistant").last.evaluate("e => e.source") == shown
    with contextlib.closing(sqlite3.connect(page.db)) as db:
        role, content, figures = db.execute(
            "SELECT role, content, figures FROM messages ORDER BY id DESC LIMIT 1"
        ).fetchone()
    assert (role, content, json.loads(figures)["finish_reason"]) == ("assistant", shown, "cancelled")
    page.fill("#max-tokens", "8")
    page.fill("#input", "Shorter, please.")
    page.click("#send")
    expect(page.locator(".msg.assistant").last.locator(".figures")).to_contain_text(
        "acceptance", timeout=60_000
    )


EVIL_PAGE = b"""<!doctype html><title>elsewhere</title><script>
async function attack(edge) {
  const out = {};
  const body = JSON.stringify({ title: "evil", prompt: "hi", max_tokens: 40,
                                messages: [{ role: "user", content: "hi" }] });
  // "Simple" requests: no preflight, the browser sends them and hides the answer.
  for (const path of ["api/conversations", "v1/completions", "v1/chat/completions"]) {
    try {
      await fetch(edge + path,
        { method: "POST", mode: "no-cors", headers: { "Content-Type": "text/plain" }, body });
      out[path] = "sent";
    } catch (e) { out[path] = "failed"; }
  }
  // A JSON request needs a preflight, which the edge does not grant to this origin.
  try {
    const r = await fetch(edge + "api/conversations", { method: "POST",
      headers: { "Content-Type": "application/json" }, body });
    out.json = r.status;
  } catch (e) { out.json = "blocked"; }
  // Reading the conversations: CORS gives this origin nothing.
  try { out.read = await (await fetch(edge + "api/conversations")).text(); }
  catch (e) { out.read = "blocked"; }
  return out;
}
</script>"""


class _Evil(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(EVIL_PAGE)

    def log_message(self, *args):
        pass


def _count(edge: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(edge + "metrics", timeout=30).read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "draftwire:edge_errors_total" and s.labels.get("status") == name
    )


def test_token_probabilities_show_on_hover(page):
    # The box checked and the message sent while New chat's conversation is being made (its reading held
    # back until then): the message goes to the new conversation, and the form stays as the user left it
    # (the page once sent to the conversation open before, and reset the box from the settings the new
    # one was made with, so no logprobs were asked; seen in CI).
    held = []

    def hold_the_first_reading(route):
        if route.request.method == "GET" and not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/api/conversations/*", hold_the_first_reading)
    before = page.evaluate("location.hash")
    page.click("#new-chat")
    while not held:
        page.wait_for_timeout(20)
    page.check("#probs")
    page.fill("#max-tokens", "16")
    page.fill("#temperature", "0")
    page.fill("#input", "Return the sum of a list.")
    page.click("#send")
    held[0].continue_()
    page.wait_for_function("h => location.hash && location.hash !== h", arg=before)
    page.unroute("**/api/conversations/*")
    expect(page.locator(".msg")).to_have_count(2)  # the new conversation's: the message and its reply
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".figures")).to_contain_text("acceptance", timeout=60_000)
    made = page.evaluate("location.hash").lstrip("#")
    stored = json.loads(urllib.request.urlopen(f"{page.url.split('#')[0]}api/conversations/{made}").read())
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    expect(page.locator("#probs")).to_be_checked()
    tokens = reply.locator(".tok")
    assert tokens.count() >= 8  # one span per token (16 at most, EOS not shown)
    assert "".join(tokens.all_inner_texts()) == reply.locator(".text").inner_text()
    title = tokens.first.get_attribute("title")
    lines = title.split("\n")
    assert len(lines) == 4 and all(line.endswith("%") for line in lines)  # the token, then 3 alternatives
    # Greedy: the token is its position's likeliest, so it heads the alternatives with its probability.
    assert lines[0].strip() == lines[1].strip()
    tokens.first.hover()


def test_a_reply_speculation_did_not_pay_for_says_so_and_why(page):
    """Whether speculation pays for the demo pair is a matter of timing, so the reply's stored figures are
    set as a reply handed to the verifier leaves them (its timings, from the API), and the page reloaded:
    the figures say speculation was off and how many tokens the verifier decoded alone, the tuner's
    reason on hover; a reply speculation paid for says nothing of it."""
    before = page.evaluate("location.hash")
    page.click("#new-chat")
    page.wait_for_function("h => location.hash && location.hash !== h", arg=before)
    ask(page, "Return the sum of a list.", 4)
    reason = "speculation off: 0.8 of the target alone's tokens/s over 24 rounds"
    made, deadline, row = page.evaluate("location.hash").lstrip("#"), time.monotonic() + 30, None
    while row is None and time.monotonic() < deadline:  # the app stores the reply as it ends it
        with contextlib.closing(sqlite3.connect(page.db)) as db:
            row = db.execute(
                "SELECT id, figures FROM messages WHERE role = 'assistant' AND conversation_id = ?", (made,)
            ).fetchone()
        time.sleep(0.1)
    mid, figures = row
    with contextlib.closing(sqlite3.connect(page.db)) as db, db:
        off = json.loads(figures)
        off["timings"].update(speculation="off", speculation_reason=reason, server_tokens=3, plain_steps=0)
        paid = {**off, "timings": {**off["timings"], "speculation": "on", "server_tokens": 0}}
        db.execute("UPDATE messages SET figures = ? WHERE id = ?", (json.dumps(off), mid))
    page.reload()
    shown = page.locator(".msg.assistant .figures").last
    expect(shown).to_contain_text("speculation off (3 decoded by the verifier alone)")
    assert shown.get_attribute("title") == reason
    with contextlib.closing(sqlite3.connect(page.db)) as db, db:
        db.execute("UPDATE messages SET figures = ? WHERE id = ?", (json.dumps(paid), mid))
    page.reload()
    expect(shown).to_contain_text("acceptance")
    assert "speculation" not in shown.inner_text()


def test_a_page_from_another_origin_cannot_drive_or_read_the_edge(page):
    edge = page.evaluate("location.origin") + "/"
    conversations = lambda: json.loads(urllib.request.urlopen(edge + "api/conversations").read())  # noqa: E731
    before, refused = conversations()["conversations"], _count(edge, "403")
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    other = page.context.browser.new_page()
    try:
        other.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
        out = other.evaluate("(edge) => attack(edge)", edge)
    finally:
        other.close()
        evil.shutdown()
    assert out["read"] == "blocked" and out["json"] == "blocked", out
    assert conversations()["conversations"] == before  # nothing created, nothing generated
    assert _count(edge, "403") >= refused + 3  # the three simple requests, refused by their Origin

    # DNS rebinding: a name that resolves to this machine, but the Host is the attacker's name.
    request = urllib.request.Request(edge + "api/conversations", headers={"Host": "rebind.example:80"})
    try:
        urllib.request.urlopen(request, timeout=30)
        raise AssertionError("a forged Host was served")
    except urllib.error.HTTPError as e:
        assert e.code == 403 and json.loads(e.read())["error"]["code"] == "host_not_allowed"


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


def _stored_reply(page) -> int:
    """The id of the open conversation's stored reply, once the app has stored it."""
    made, deadline, row = page.evaluate("location.hash").lstrip("#"), time.monotonic() + 30, None
    while row is None and time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(page.db)) as db:
            row = db.execute(
                "SELECT id FROM messages WHERE role = 'assistant' AND conversation_id = ? ORDER BY id DESC",
                (made,),
            ).fetchone()
        time.sleep(0.1)
    return row[0]


MARKDOWN = """Here is **the sum**, with `sum(xs)`:

```python
def total(xs):
    return sum(xs) < 3
```

<img src=x onerror="window.pwned = 1"><script>window.pwned = 2</script>
[a link](javascript:window.pwned=3) <iframe src="javascript:window.pwned=4"></iframe>
"""


def test_a_reply_renders_its_markdown_and_code_and_nothing_in_it_runs(page):
    """A reply is markdown (the realistic pair is a code model): shown with its emphasis and code blocks,
    and whatever HTML or script a model writes is stripped before it reaches the page (a stored reply's
    text is set so, as a model could have written it, and the page reloaded)."""
    before = page.evaluate("location.hash")
    page.click("#new-chat")
    page.wait_for_function("h => location.hash && location.hash !== h", arg=before)
    ask(page, "Return the sum of a list.", 4)
    mid = _stored_reply(page)
    with contextlib.closing(sqlite3.connect(page.db)) as db, db:
        db.execute("UPDATE messages SET content = ? WHERE id = ?", (MARKDOWN, mid))
    page.reload()
    text = page.locator(".msg.assistant .text").last
    expect(text.locator("strong")).to_have_text("the sum")
    expect(text.locator("p code").first).to_have_text("sum(xs)")
    expect(text.locator("pre code")).to_have_text("def total(xs):\n    return sum(xs) < 3\n")
    assert text.locator("script, iframe, img, [onerror]").count() == 0  # nothing runs, nothing is fetched
    assert text.locator("a[href^='javascript']").count() == 0
    page.wait_for_timeout(300)  # an image's error handler would have run by now
    assert page.evaluate("window.pwned") is None
    # The user's own message is plain text, markdown and all.
    assert page.locator(".msg.user .text").last.inner_text() == "Return the sum of a list."


def test_a_reply_shows_it_is_coming_between_send_and_its_first_token(page):
    """The message's request held back: the reply's bubble says it is typing until its first token."""
    held = []

    def hold(route):
        if route.request.method == "POST" and not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/api/conversations/*/messages", hold)
    page.fill("#max-tokens", "4")
    page.fill("#input", "Return the sum of a list.")
    page.click("#send")
    while not held:
        page.wait_for_timeout(20)
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_class(re.compile(r"\btyping\b"))
    assert "typing" in reply.locator(".text").evaluate("e => getComputedStyle(e, '::after').content")
    held[0].continue_()
    expect(reply.locator(".figures")).to_contain_text("acceptance", timeout=60_000)
    expect(reply).not_to_have_class(re.compile(r"\btyping\b"))
    page.unroute("**/api/conversations/*/messages")


def test_the_page_has_an_icon_and_asks_for_nothing_missing(page):
    missing = []
    page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
    page.reload()
    expect(page.locator("#model")).to_contain_text("verified remotely")
    assert missing == []
    base = page.url.split("#")[0]
    icon = page.locator("link[rel=icon]").get_attribute("href")
    for path in (icon.lstrip("/"), "favicon.ico"):  # the page's link, and where other clients look
        with urllib.request.urlopen(base + path, timeout=30) as response:
            assert response.headers["Content-Type"].startswith("image/")
            assert b"<svg" in response.read()


def test_the_probabilities_box_sits_beside_its_label(page):
    box = page.locator("#probs").bounding_box()
    words = page.evaluate(
        """() => { const r = document.createRange();
        r.selectNodeContents(document.querySelector("#probs").parentNode.lastChild);
        const b = r.getBoundingClientRect(); return { x: b.x, y: b.y, height: b.height }; }"""
    )
    assert 0 <= words["x"] - (box["x"] + box["width"]) < 12, (box, words)
    assert abs((box["y"] + box["height"] / 2) - (words["y"] + words["height"] / 2)) < 8, (box, words)


def test_at_420_px_the_sidebar_folds_away_and_the_chat_takes_the_width(page):
    narrow = page.context.browser.new_page(viewport={"width": 420, "height": 800})
    try:
        narrow.goto(page.url.split("#")[0])
        expect(narrow.locator("#model")).to_contain_text("verified remotely")
        expect(narrow.locator("#sidebar")).not_to_be_visible()
        assert narrow.locator("main").bounding_box()["width"] >= 400
        send = narrow.locator("#send").bounding_box()
        assert send["x"] + send["width"] <= 420
        assert narrow.locator("#input").bounding_box()["width"] >= 250
        narrow.click("#menu")  # ☰ opens it over the chat; choosing a conversation closes it
        expect(narrow.locator("#sidebar")).to_be_visible()
        expect(narrow.locator("#conversations li").first).to_be_visible()
        narrow.locator("#conversations li span").first.click()
        expect(narrow.locator("#sidebar")).not_to_be_visible()
        expect(narrow.locator(".msg").first).to_be_visible()
    finally:
        narrow.close()
