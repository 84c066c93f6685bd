"""The studio in a real browser: Debian's headless Chromium, driven by playwright, against a real
`python -m radixlm.launch_server --api-key ...` serving examples/tree_of_thought.py,
examples/json_extraction.py and two test programs. References are independent of the page: the
same program run through plain POST /programs/{name}, the program file's own line numbers, and the
server's KV counters. Skipped, with the reason, when chromium or playwright is missing."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import launch_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
try:
    from playwright.sync_api import Page, sync_playwright
except ImportError:  # pragma: no cover - the skip below says why
    sync_playwright = None  # type: ignore[assignment]
# Chromium reserves ~90 GB of address space (V8's sandbox and heap cages; not memory) and dies
# with SIGTRAP under a smaller `ulimit -v`.
ADDRESS_SPACE_NEEDED = 100_000_000 * 1024
_as_limit = resource.getrlimit(resource.RLIMIT_AS)[0]
pytestmark = [
    pytest.mark.skipif(
        sync_playwright is None or not os.access(CHROMIUM, os.X_OK),
        reason="needs Debian's chromium (apt-get install -y chromium chromium-driver) and pip playwright",
    ),
    pytest.mark.skipif(
        _as_limit != resource.RLIM_INFINITY and _as_limit < ADDRESS_SPACE_NEEDED,
        reason="ulimit -v is below what Chromium reserves (100000000 KiB of address space)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
KEY = "studio-test-key"
RUN_WAIT_MS = 180_000
PROBLEM = "A farmer has 12 sheep and buys 5 more. How many sheep does he have?"
PROGRAMS = textwrap.dedent('''
    import radixlm as sgl

    @sgl.function
    def story(s, topic: str = "rain"):
        """A long story (to leave midway)."""
        s += "A long story about " + topic + ":" + sgl.gen("story", max_tokens=400, ignore_eos=True)

    @sgl.function
    def broken(s, word: str = "hello"):
        """Generates a little, then raises."""
        s += "Repeat: " + word + "\\n" + sgl.gen("echo", max_tokens=2)
        raise ValueError("broken on purpose")
''')
BROKEN_LINE = next(i for i, line in enumerate(PROGRAMS.splitlines(), 1) if "raise ValueError" in line)


class Server:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    def idle_stats(self, timeout_s: float = 60) -> dict[str, Any]:
        """The engine's counters once nothing runs and the prefix cache is flushed."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.http.get("/studio/api/metrics").json()
            idle = m["num_running"] == 0 and m["num_waiting"] == 0 and m["server_pending"] == 0
            if idle and self.http.post("/flush_cache").status_code == 200:
                return self.http.get("/studio/api/metrics").json()
            assert time.monotonic() < deadline, m
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    progs = tmp_path_factory.mktemp("studio") / "programs.py"
    progs.write_text(PROGRAMS)
    args = ["--api-key", KEY, "--device", "cpu", "--log-level", "warning", "--drain-timeout", "2",
            "--programs", str(ROOT / "examples" / "tree_of_thought.py"),
            "--programs", str(ROOT / "examples" / "json_extraction.py"), "--programs", str(progs)]  # fmt: skip
    proc, url = launch_server(args, progs.parent / "server.log")
    yield Server(url)
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    user_dir = tempfile.mkdtemp(prefix="radixlm-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            user_dir, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1280, "height": 800}, accept_downloads=True,
        )  # fmt: skip
        context.set_default_timeout(30_000)
        yield context
        context.close()
    shutil.rmtree(user_dir, ignore_errors=True)


@pytest.fixture
def studio(browser: Any, server: Server) -> Iterator[tuple[Page, list[str]]]:
    """A signed-in studio page, and the console errors it logs from its first load on."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/studio")
    signing_in = page.locator("#key").count() > 0
    if signing_in:
        page.fill("#key", KEY)
        page.click("button[type=submit]")
    page.wait_for_selector("#program option[value=tree_of_thought]", state="attached")
    if signing_in:
        # The key form's own 401 status is the one error logged before the studio loads; Chromium
        # may report it after the form's load event, so it is dropped once the studio is up.
        assert [e for e in errors if "401" not in e] == []
        errors.clear()
    yield page, errors
    if not page.is_closed():
        page.close()


def run_in_page(page: Page, program: str, args: dict[str, str], max_new_tokens: int = 16) -> str:
    page.select_option("#program", program)
    for name, value in args.items():
        page.fill(f"#arg-{name}", value)
    page.fill("#max-new-tokens", str(max_new_tokens))
    page.fill("#temperature", "0")
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#run').disabled === false", timeout=RUN_WAIT_MS)
    return page.inner_text("#status")


NODE_TEXTS = """() => [...document.querySelectorAll('#tree section.node')].map(sec => ({
    node: sec.dataset.node, branch: sec.classList.contains('branch'),
    text: [...sec.querySelectorAll(':scope > .node-body > .text > .seg')].map(s => s.textContent).join('')}))"""


def no_horizontal_overflow(page: Page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_api_key_guards_the_page_and_its_streams(server: Server) -> None:
    anon = httpx.Client(base_url=server.url, timeout=30)
    page = anon.get("/studio")
    assert page.status_code == 401 and 'name="key"' in page.text and "tree_of_thought" not in page.text
    for method, path in [("GET", "/studio/static/studio.js"), ("GET", "/studio/api/metrics"),
                         ("POST", "/programs/broken/trace"), ("GET", "/programs")]:  # fmt: skip
        assert anon.request(method, path, json={"args": {}}).status_code == 401, path
    assert anon.post("/studio/login", data={"key": "wrong"}).status_code == 401
    ok = anon.post("/studio/login", data={"key": KEY})
    assert ok.status_code == 303 and "httponly" in ok.headers["set-cookie"].lower()
    assert "samesite=strict" in ok.headers["set-cookie"].lower() and KEY not in ok.headers["set-cookie"]
    signed_in = anon.get("/studio")  # the client kept the session cookie
    assert (
        signed_in.status_code == 200 and "script-src 'self'" in signed_in.headers["content-security-policy"]
    )
    assert anon.get("/studio/static/trace_view.js").status_code == 200
    with anon.stream("POST", "/programs/broken/trace", json={"args": {"word": "x"}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[0]["type"] == "run" and events[-1]["type"] == "done" and events[-1]["ok"] is False
    assert [e["seq"] for e in events] == list(range(len(events)))


def test_tree_of_thought_runs_in_the_browser(studio: tuple[Page, list[str]], server: Server) -> None:
    page, errors = studio
    status = run_in_page(page, "tree_of_thought", {"problem": PROBLEM, "width": "3"})
    assert status.startswith("Finished tree_of_thought"), status
    ref = server.http.post("/programs/tree_of_thought", json={
        "args": {"problem": PROBLEM, "width": 3}, "temperature": 0, "max_new_tokens": 16}).json()  # fmt: skip
    nodes = page.evaluate(NODE_TEXTS)
    root = [n for n in nodes if not n["branch"]]
    branches = [n for n in nodes if n["branch"]]
    assert len(root) == 1 and root[0]["text"] == ref["text"]
    approaches = ["write an equation", "count directly", "reason in words"]
    assert [b["text"] for b in branches] == [
        f"Step 1 ({approaches[i]}):{ref['variables']['step'][i]}\nIs this step correct? Answer yes or no: "
        f"{ref['variables']['verdict'][i]}"
        for i in range(3)
    ]
    tables = page.locator("#tree table.scores")
    assert tables.count() == 3
    for i in range(3):
        rows = tables.nth(i).locator("tr").all_inner_texts()
        assert [r.split("\t")[0].lstrip("✓ ") for r in rows[1:]] == ["yes", "no"]
        scores = [float(r.split("\t")[1]) for r in rows[1:]]
        want = ref["meta_info"]["verdict"][i]["normalized_prompt_logprobs"]
        assert scores == pytest.approx(want, abs=1e-3)
        chosen = tables.nth(i).locator("tr.chosen").inner_text()
        assert ref["variables"]["verdict"][i] in chosen
    assert page.locator("#tree .seg.cached").count() > 0 and page.locator("#tree .node.done").count() == 4
    assert page.locator("#history-list button").count() >= 1 and no_horizontal_overflow(page)
    page.screenshot(path=str(Path(tempfile.gettempdir()) / "radixlm-studio.png"), full_page=True)
    if os.environ.get("RADIXLM_STUDIO_SCREENSHOT"):  # how docs/studio.png is made
        page.screenshot(path=os.environ["RADIXLM_STUDIO_SCREENSHOT"], full_page=False)
    assert errors == []


def test_json_schema_span_is_marked_constrained(studio: tuple[Page, list[str]], server: Server) -> None:
    page, errors = studio
    text = "Maria is a 34 year old nurse who lives in Lisbon."
    assert run_in_page(page, "extract_person", {"text": text}, 48).startswith("Finished")
    ref = server.http.post("/programs/extract_person", json={"args": {"text": text}, "temperature": 0}).json()
    constrained = page.locator("#tree .seg.generated.constrained")
    assert json.loads("".join(constrained.all_text_contents())) == ref["variables"]["person"]
    assert page.locator("#tree .seg.jump-forward").count() > 0
    assert "json_schema" in constrained.first.get_attribute("data-label")
    assert errors == []


def test_a_program_that_raises_shows_the_error_and_line(studio: tuple[Page, list[str]]) -> None:
    page, errors = studio
    status = run_in_page(page, "broken", {"word": "hi"})
    assert "ValueError: broken on purpose" in status and f"line {BROKEN_LINE}" in status
    box = page.locator("#tree .error-box")
    assert box.count() == 1 and box.get_attribute("role") == "alert"
    assert (
        f"line {BROKEN_LINE}" in box.inner_text()
        and 'raise ValueError("broken on purpose")' in box.inner_text()
    )
    assert errors == []


def test_closing_the_tab_mid_run_aborts_its_requests(studio: tuple[Page, list[str]], server: Server) -> None:
    page, _ = studio
    before = server.idle_stats()
    page.select_option("#program", "story")
    page.fill("#max-new-tokens", "400")
    page.click("#run")
    page.wait_for_function(
        "() => document.querySelectorAll('#tree .seg.generated').length >= 3", timeout=RUN_WAIT_MS
    )
    page.close()  # the tab goes: the browser drops the stream
    after = server.idle_stats()
    assert after["num_aborted"] - before["num_aborted"] == 1
    assert after["generated_tokens"] - before["generated_tokens"] < 400
    assert after["kv_free_slots"] == before["kv_free_slots"] == before["kv_total_slots"]


def test_keyboard_only_at_phone_size(studio: tuple[Page, list[str]]) -> None:
    page, errors = studio
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    page.wait_for_selector("#program option[value=broken]", state="attached")
    for _ in range(10):  # Tab from the top of the page to the program picker
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "program":
            break
    assert page.evaluate("document.activeElement.id") == "program"
    page.keyboard.type("b")  # a select jumps to the option starting with the typed letter
    assert page.input_value("#program") == "broken"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "arg-word"
    page.keyboard.type("kb")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#history-list button", timeout=RUN_WAIT_MS)
    page.wait_for_function("() => document.querySelector('#run').disabled === false")
    for _ in range(20):  # on to the download button, through the history entry
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "download":
            break
    with page.expect_download() as dl:
        page.keyboard.press("Enter")
    saved = json.loads(Path(dl.value.path()).read_text())
    assert saved["program"] == "broken" and saved["events"][-1]["type"] == "done"
    assert no_horizontal_overflow(page)
    for sel in ("#run", "#program", "#tree .node", "#metrics"):
        box = page.locator(sel).first.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, sel
    font_px = page.evaluate("parseFloat(getComputedStyle(document.querySelector('#tree .text')).fontSize)")
    assert font_px >= 12
    assert errors == []


def test_cli_prints_the_tree(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    from radixlm.trace_cli import main

    args = [server.url, "tree_of_thought", "--api-key", KEY, "--temperature", "0", "--no-color",
            "--args", "problem=What is 2+3?", "width=2"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fork f0: 2 branches" in out and "● branch 2" in out and "select verdict" in out
    assert main([server.url, "broken", "--api-key", KEY]) == 1
    assert "broken on purpose at " in capsys.readouterr().out.replace("\n", " ")
