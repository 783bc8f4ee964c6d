"""The explorer in a real headless Chromium (Debian's, driven by Playwright; nothing downloaded),
served by the real `prx-corpus browse` command. Screenshots go to test-artifacts/explorer/."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from explorer_corpora import write_small_corpus
from playwright.sync_api import Browser, Page, expect, sync_playwright
from test_metadata import HOSTILE_KEY, HOSTILE_VALUE, URLS, source_metadata

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialling Google on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
CLI = str(Path(sys.executable).with_name("prx-corpus"))
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "explorer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(explorer_corpus: ExplorerCorpus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from browse(explorer_corpus.root, tmp_path_factory)


@pytest.fixture(scope="module")
def meta_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The explorer over a small corpus whose samples carry (hostile) metadata and source URLs."""
    root = tmp_path_factory.mktemp("meta-browse") / "corpus"
    write_small_corpus(root, metadata=source_metadata)
    yield from browse(root, tmp_path_factory)


def browse(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`prx-corpus browse` on a free loopback port, until it answers /healthz."""
    port = free_port()
    log = tmp_path_factory.mktemp("browse") / "browse.log"
    env = {k: v for k, v in os.environ.items() if k != "PRX_CONFIG"}
    with log.open("w") as out:
        process = subprocess.Popen([CLI, "browse", "--root", str(root), "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=5).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"prx-corpus browse did not start:\n{log.read_text()}")
            time.sleep(0.3)
    yield url
    process.terminate()
    process.wait(timeout=10)


LOOP = "g theads theads theads theads theads theads theads theads theads theads theads theads"
CAPTIONER_ID = "transformers:tiny-qwen2-vl:0123456789ab"


def checked_caption(i: int) -> dict:
    """Sample i's caption with its check: every tenth a rejected loop, the next a retried one, words growing with i."""
    base = {"content_id": f"c{i}", "captioner_version": "cap-1", "captioner_id": CAPTIONER_ID, "error": ""}
    if i % 10 == 1:
        return {**base, "caption": LOOP, "word_count": len(LOOP.split()), "verdict": "rejected",
                "problem": "repetition", "finish_reason": "length", "attempts": 2}
    text = " ".join(["a photo of", *(f"thing{j}" for j in range(i + 2))])
    retried = i % 10 == 2
    return {**base, "caption": text, "word_count": len(text.split()), "verdict": "retried" if retried else "ok",
            "problem": "token_cap" if retried else None, "finish_reason": "stop", "attempts": 2 if retried else 1}


@pytest.fixture(scope="module")
def quality_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The explorer over a small corpus whose model captions carry the caption checks' verdicts."""
    import pyarrow as pa

    from explorer_corpora import write_explorer
    from prx_core.store import lance_io, schemas

    storage = write_small_corpus(tmp_path_factory.mktemp("quality-browse") / "corpus")
    rows = pa.Table.from_pylist([checked_caption(i) for i in range(40)], schema=schemas.CAPTIONS)
    lance_io.overwrite(storage.lance_uri("captions"), rows)
    write_explorer(storage)
    yield from browse(Path(storage.root), tmp_path_factory)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("dialog", lambda dialog: pytest.fail(f"a dialog opened: {dialog.message}"))
    yield page
    context.close()


def loaded_images(page: Page, selector: str) -> list[int]:
    """naturalWidth of every image under `selector` once loaded (0 means broken). Polled from
    Python: Playwright's wait_for_function polls with an eval that the explorer's CSP refuses
    whenever the images are not complete at the first look (a busy machine)."""
    deadline = time.monotonic() + 30
    while not all(page.eval_on_selector_all(selector, "imgs => imgs.map(i => i.complete)")):
        assert time.monotonic() < deadline, f"images under {selector!r} still loading after 30 s"
        page.wait_for_timeout(100)
    return page.eval_on_selector_all(selector, "imgs => imgs.map(i => i.naturalWidth)")


def test_search_open_result_follow_duplicate_group(page: Page, server: str, explorer_corpus: ExplorerCorpus) -> None:
    page.goto(server)
    page.get_by_label("search captions").fill("astronaut")
    page.get_by_role("button", name="Search").click()
    expect(page.locator("#result-count")).to_contain_text("results for")
    marks = page.locator("mark")
    assert marks.count() >= 1 and marks.first.inner_text().lower() == "astronaut"
    expect(page.locator("ul.grid .badge.score").first).to_have_text(re.compile(r"^match \d+\.\d$"))  # says what it is
    assert all(w > 0 for w in loaded_images(page, "ul.grid img"))
    page.screenshot(path=str(SHOTS / "01-search.png"), full_page=True)

    page.locator("ul.grid a.sid").first.click()
    expect(page.locator("#caption")).to_contain_text("stronaut")
    expect(page.locator("#caption-by")).to_contain_text("Source caption")  # no VLM ran: named for what made it
    page.screenshot(path=str(SHOTS / "02-detail.png"), full_page=True)
    page.get_by_role("link", name="More like this (caption)").click()
    distances = page.locator("ul.grid .badge.score")
    expect(distances.first).to_have_text(re.compile(r"^distance \d\.\d{3}$"))  # labelled, never "-0.000"
    assert not any(text.startswith("distance -") for text in distances.all_inner_texts())
    page.go_back()

    copy = next(e for e in explorer_corpus.manifest if e.get("role") == "copy")
    page.goto(f"{server}/sample?id={copy['sample_id']}")
    expect(page.locator("section.group .card.keeper")).to_have_count(1)
    members = page.locator("section.group .card").count()
    scores = page.locator("section.group .card:not(.keeper) .badge.score")  # how far each copy is from its keeper
    expect(scores).to_have_count(members - 1)
    expect(scores.first).to_contain_text("of 1")
    expect(page.locator("section.group .card:not(.keeper) .badge.distance").first).to_contain_text("pHash distance")
    page.screenshot(path=str(SHOTS / "03-duplicate.png"), full_page=True)
    page.locator("#group-link").click()
    expect(page.locator("#result-count")).to_contain_text(f"{members} images")
    expect(page.locator("ul.grid li.card")).to_have_count(members)
    page.screenshot(path=str(SHOTS / "04-group.png"), full_page=True)


def test_overview_plots_render(page: Page, server: str) -> None:
    page.goto(f"{server}/overview")
    widths = loaded_images(page, ".plots img")
    assert len(widths) == 5 and all(w > 400 for w in widths)
    page.screenshot(path=str(SHOTS / "05-overview.png"), full_page=True)


def test_xss_caption_is_inert(page: Page, server: str, explorer_corpus: ExplorerCorpus) -> None:
    [entry] = explorer_corpus.planted("hostile_caption")
    page.goto(f"{server}/?q=xsslink")
    expect(page.locator("ul.grid li.card")).to_have_count(1)
    page.locator("ul.grid a.sid").first.click()
    original = page.locator("#original-caption")
    expect(original).to_contain_text('<script>document.title="XSS-script"</script>')
    expect(original).to_contain_text("onerror=")
    assert original.locator("script, img, a").count() == 0, "the caption made no elements"
    page.get_by_text("xsslink").first.click()  # plain text: clicking it goes nowhere
    assert not page.title().startswith("XSS"), page.title()
    assert page.url.endswith(entry["sample_id"].replace("/", "%2F")) or "sample?id=" in page.url
    page.screenshot(path=str(SHOTS / "06-xss-inert.png"), full_page=True)


def test_a_caption_preview_shows_in_the_explorer(page: Page, server: str, explorer_corpus: ExplorerCorpus) -> None:
    """`prx-corpus preview --root` (the real command, the `source` captioner) and the explorer's Previews page."""
    demo = explorer_corpus.demo
    done = subprocess.run([CLI, "preview", "--sources", str(demo / "sources.yaml"), "--source", "web_images",
                           "--sample", "4", "--root", str(explorer_corpus.root)], capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "PRX_CONFIG"})
    assert done.returncode == 0, done.stdout + done.stderr
    page.goto(server)
    page.get_by_role("link", name="Previews").click()
    run = page.locator("section.preview")
    expect(run).to_have_count(1)
    expect(run.locator("h2")).to_contain_text("web_images · source")
    expect(run.locator(".summary")).to_contain_text("4 images")
    expect(run.locator(".summary")).to_contain_text("GPU-hours at the plan's rate")
    expect(run.locator("li.card")).to_have_count(4)
    expect(run.locator(".caption-by").first).to_have_text("Source caption (no model ran)")
    expect(run.locator(".badge.check").first).to_have_text(re.compile(r"^check: (ok|flagged)"))
    assert all(w > 0 for w in loaded_images(page, "section.preview img"))
    page.screenshot(path=str(SHOTS / "08-previews.png"), full_page=True)
    page.locator("section.preview h2 a").click()  # the source's own runs
    expect(page.locator("h1")).to_have_text("Caption previews of web_images")


def test_hostile_metadata_and_source_urls_are_inert(page: Page, meta_server: str) -> None:
    page.goto(f"{meta_server}/sample?id=tiny/007")
    entries = page.locator("#metadata")
    expect(entries).to_contain_text(HOSTILE_KEY)
    expect(entries).to_contain_text(HOSTILE_VALUE)
    assert entries.locator("script, img").count() == 0, "the metadata made no elements"
    assert not page.title().startswith("XSS"), page.title()  # (a dialog would have failed the test already)
    page.screenshot(path=str(SHOTS / "07-metadata.png"), full_page=True)

    page.goto(f"{meta_server}/sample?id=tiny/001")  # a javascript: source URL: text, not a link
    expect(page.locator("#source-url")).to_have_text(URLS[1])
    assert page.locator("#source-url a").count() == 0
    page.goto(f"{meta_server}/sample?id=tiny/000")  # an https one: a link that tells nothing to where it leads
    link = page.locator("#source-url a")
    assert link.get_attribute("href") == URLS[0] and link.get_attribute("rel") == "noopener noreferrer nofollow"


def test_a_metadata_value_links_to_its_filter(page: Page, meta_server: str) -> None:
    page.goto(f"{meta_server}/sample?id=tiny/009")
    page.locator("#metadata").get_by_role("link", name="cat & dog: mixed").click()
    expect(page.locator("#result-count")).to_contain_text("1 images")
    expect(page.locator("ul.grid li.card")).to_have_count(1)
    expect(page.locator("select[name=meta]")).to_have_value("label:cat & dog: mixed")


def test_caption_problems_filter_and_the_worst_captions(page: Page, quality_server: str) -> None:
    """The view the PRX team used to find poor captions: a filter by caption problem, and the
    worst captions (shortest, longest, most repetitive, retried), each opening the sample's checks."""
    page.goto(quality_server)
    page.locator("select[name=caption]").select_option("repetition")
    page.get_by_role("button", name="Search").click()
    expect(page.locator("#result-count")).to_contain_text("4 images")
    expect(page.locator("ul.grid .badge.caption-problem")).to_have_count(4)
    expect(page.locator("ul.grid .badge.caption-problem").first).to_have_text("caption rejected: repetition")
    page.screenshot(path=str(SHOTS / "08-caption-problem.png"), full_page=True)

    page.goto(quality_server)
    page.locator("#worst-captions").get_by_role("link", name="most repetitive").click()
    expect(page.locator("#result-count")).to_contain_text("worst captions by repetition")
    first = page.locator("ul.grid a.sid").first.inner_text()
    assert int(first.split("/")[1]) % 10 == 1, first  # a loop comes first
    expect(page.locator("ul.grid .badge.score").first).to_contain_text("repetition 0.")
    page.screenshot(path=str(SHOTS / "09-worst-repetitive.png"), full_page=True)

    page.locator("#worst-captions").get_by_role("link", name="shortest").click()
    expect(page.locator("ul.grid .badge.score").first).to_have_text("5 words")  # sample 0: "a photo of thing0 thing1"
    page.locator("#worst-captions").get_by_role("link", name="retried").click()
    expect(page.locator("#result-count")).to_contain_text("8 worst captions by retried")  # 4 rejected + 4 retried
    expect(page.locator("ul.grid .badge.score").first).to_have_text("2 attempts")

    page.goto(f"{quality_server}/sample?id=tiny/011")
    expect(page.locator("#caption-by")).to_have_text(f"Caption by {CAPTIONER_ID}")
    expect(page.locator("#caption-check")).to_contain_text("rejected (repetition) · 2 generations")
    expect(page.locator("#caption-check")).to_contain_text("not in the MDS output")
    page.screenshot(path=str(SHOTS / "10-rejected-caption.png"), full_page=True)
