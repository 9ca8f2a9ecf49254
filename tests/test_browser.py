"""A real browser (Debian's chromium, driven by Playwright) using the app as a person would."""
from __future__ import annotations

import os
import shutil

import pytest

from dynchat.vllm.server import free_port

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser_page(tiny_preset, tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; tests/run.sh installs it with apt-get")
        pytest.skip("chromium not installed (tests/run.sh installs it)")
    playwright = pytest.importorskip("playwright.sync_api")
    from dynchat.app.store import Store
    from dynchat.app.ui import create_app, launch

    demo = create_app(Store(tmp_path_factory.mktemp("db") / "browser.db"), tiny_preset)
    port = free_port()
    launch(demo, server_port=port, prevent_thread_lock=True, quiet=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(accept_downloads=True, viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("textarea")
        yield demo, page
        browser.close()
    demo.close()


def test_chat_stream_metrics_mode_switch_and_csv(browser_page, tmp_path):
    demo, page = browser_page
    box = page.get_by_placeholder("Ask something ...")
    box.fill("What does the function json.dumps do?")
    send = page.get_by_role("button", name="Send")
    send.click()
    page.wait_for_function("document.querySelector('textarea').disabled", timeout=10_000)   # one reply at a time
    page.get_by_text("speedup").first.wait_for(timeout=60_000)        # metrics after the baseline comparison
    page.wait_for_function("!document.querySelector('textarea').disabled", timeout=30_000)
    assert page.locator(".message.bot, [data-testid='bot']").count() >= 1
    assert "tokens/s" in page.content()
    # what the speedup was measured against, under the reply, and greedy's lossless check beside the figures
    body = page.inner_text("body")
    assert "plain decoding of the same prompt" in body and "same tokens as the baseline" in body

    page.get_by_role("radio", name="baseline").check()                 # switch mode
    box.fill("And json.loads?")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function("document.body.innerText.includes('speedup** 1.00x') || "
                           "document.body.innerText.includes('1.00x')", timeout=60_000)
    turns = demo.service.store.all_turns()
    assert list(turns["mode"]) == ["assistant", "baseline"] and set(turns["status"]) == {"ok"}

    page.get_by_role("tab", name="session turns").click()
    with page.expect_download(timeout=30_000) as info:
        page.get_by_role("button", name="Download CSV").click()
    path = tmp_path / "turns.csv"
    info.value.save_as(path)
    text = path.read_text()
    assert "json.dumps" in text and "json.loads" in text, text[:3000]
    page.screenshot(path=str(tmp_path / "app.png"), full_page=True)


def test_a_preset_that_fails_says_so_and_keeps_the_current_one(browser_page):
    demo, page = browser_page
    dropdown = page.get_by_label("preset")
    dropdown.click()
    page.get_by_role("option", name="unreachable").click()
    page.get_by_text("is unavailable").first.wait_for(timeout=60_000)       # the warning toast
    page.wait_for_function("document.querySelector('input[aria-label=\"preset\"]').value === 'tiny'", timeout=30_000)
    # switching to a preset that loads updates the modes and the examples
    dropdown.click()
    page.get_by_role("option", name="target-only").click()
    page.get_by_text("examples (target-only)").wait_for(timeout=60_000)
    assert page.get_by_role("radio", name="assistant").count() == 0
    n = len(demo.service.store.all_turns())
    page.get_by_placeholder("Ask something ...").fill("still there?")
    page.get_by_role("button", name="Send").click()
    import time

    for _ in range(600):           # the new turn is logged, then finished
        turns = demo.service.store.all_turns()
        if len(turns) > n and turns["status"].iloc[-1] != "running":
            break
        time.sleep(0.1)
    assert list(turns["status"].iloc[n:]) == ["ok"] and turns["preset"].iloc[-1] == "target-only"


def test_a_refused_message_says_why_and_the_page_takes_the_next_one(browser_page):
    """An empty message is refused with one line; the inputs, disabled while a turn runs, take messages
    again (a refused turn had left them disabled until the page was reloaded) and the next is answered."""
    demo, page = browser_page
    n = len(demo.service.store.all_turns())
    page.get_by_placeholder("Ask something ...").fill("   ")
    page.get_by_role("button", name="Send").click()
    page.get_by_text("the message is empty").first.wait_for(timeout=30_000)
    page.wait_for_function("!document.querySelector('textarea').disabled", timeout=30_000)
    assert len(demo.service.store.all_turns()) == n             # nothing logged for it
    page.get_by_placeholder("Ask something ...").fill("One more question?")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function("document.querySelector('textarea').disabled", timeout=10_000)
    page.wait_for_function("!document.querySelector('textarea').disabled", timeout=120_000)
    turns = demo.service.store.all_turns()
    assert len(turns) == n + 1 and turns["status"].iloc[-1] == "ok"


def test_a_long_paste_is_kept_whole_and_refused_with_its_length(browser_page):
    """A message pasted past the limit stays whole in the box (the box once cut it at 4,000 characters
    without a word, and the model answered the cut text) and is refused with its real length."""
    from dynchat.app.turns import MAX_MESSAGE_CHARS

    demo, page = browser_page
    n = len(demo.service.store.all_turns())
    text = "Summarize this text: " + "The river rose all night and the town woke to water in the streets. " * 480
    assert len(text) > MAX_MESSAGE_CHARS
    page.get_by_placeholder("Ask something ...").click()
    page.evaluate("t => document.execCommand('insertText', false, t)", text)   # as a paste: the box's own input
    assert page.evaluate("document.querySelector('textarea').value.length") == len(text)
    page.get_by_role("button", name="Send").click()
    page.get_by_text(f"the message is {len(text)} characters long").first.wait_for(timeout=30_000)
    page.wait_for_function("!document.querySelector('textarea').disabled", timeout=30_000)
    assert len(demo.service.store.all_turns()) == n
