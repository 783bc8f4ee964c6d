"""The explorer's pages and JSON API over a corpus the pipeline built: every answer is checked
against the Lance tables and skip-lists themselves, or against what the demo planted."""

from __future__ import annotations

import io
import time
from html.parser import HTMLParser
from typing import TYPE_CHECKING

import pytest
from PIL import Image
from starlette.testclient import TestClient

from prx_core.image.buckets import Bucket, crop_box
from prx_core.models.caption_keys import source_caption_key
from prx_core.shards.skiplists.files import read_skip_lists
from prx_core.store import lance_io
from prx_core.store.storage import Storage
from prx_explorer.search import PAGE_SIZE

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus


def table(corpus: ExplorerCorpus, name: str, columns: list[str] | None = None, where: str | None = None) -> list[dict]:
    return lance_io.read_table(Storage(str(corpus.root)).lance_uri(name), columns, where).to_pylist()


def search(client: TestClient, **params: str) -> dict:
    response = client.get("/api/search", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def all_ids(client: TestClient, **params: str) -> list[str]:
    """Every sample_id of a search, through pagination."""
    first = search(client, **params)
    ids = [r["sample_id"] for r in first["rows"]]
    for page in range(2, first["pages"] + 1):
        ids += [r["sample_id"] for r in search(client, **params, page=str(page))["rows"]]
    assert len(ids) == first["total"] == len(set(ids))
    return ids


class Tags(HTMLParser):
    """Every start tag with its attributes, to prove what the browser would build."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def parse(html: str) -> Tags:
    tags = Tags()
    tags.feed(html)
    return tags


# -- browsing and filters -------------------------------------------------------------------------------

def test_browse_lists_every_sample_and_ingest_reject(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    samples = table(explorer_corpus, "samples", ["sample_id"])
    ingest = {r["sample_id"] for r in table(explorer_corpus, "rejects", ["sample_id", "stage"], "stage = 'samples'")}
    assert set(all_ids(client)) == {r["sample_id"] for r in samples} | ingest
    assert len(explorer_corpus.manifest) == len(samples) + len(ingest)


@pytest.mark.parametrize("reason", ["aspect_ratio", "below_floor", "truncated", "not_an_image"])
def test_rejected_filter_finds_exactly_the_planted(client: TestClient, explorer_corpus: ExplorerCorpus, reason: str) -> None:
    planted = {e["sample_id"] for e in explorer_corpus.manifest if e["reject"] == reason}
    assert planted, reason
    assert set(all_ids(client, rejected=reason)) == planted


def test_skipped_filter_matches_the_skip_list_files(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    skips = read_skip_lists(str(explorer_corpus.root))
    by_reason: dict[str, set[str]] = {}
    for skip in skips:
        by_reason.setdefault(skip.reason, set()).update(skip.sample_ids)
    assert by_reason.get("duplicate") and by_reason.get("text")
    for reason, ids in by_reason.items():
        assert set(all_ids(client, skipped=reason)) == ids, reason
    assert set(all_ids(client, skipped="yes")) == set().union(*by_reason.values())
    assert not set(all_ids(client, skipped="no")) & set().union(*by_reason.values())


def test_label_tier_bucket_and_source_filters_agree_with_the_tables(client: TestClient,
                                                                     explorer_corpus: ExplorerCorpus) -> None:
    buckets = table(explorer_corpus, "buckets", ["sample_id", "source", "tier", "bucket"], "tier IS NOT NULL")
    bucket = max({r["bucket"] for r in buckets}, key=lambda b: sum(r["bucket"] == b for r in buckets))
    assert set(all_ids(client, bucket=bucket)) == {r["sample_id"] for r in buckets if r["bucket"] == bucket}
    assert set(all_ids(client, tier="1024")) == {r["sample_id"] for r in buckets if r["tier"] == 1024}
    assert set(all_ids(client, source="web_images", tier="1024")) == {
        r["sample_id"] for r in buckets if r["tier"] == 1024 and r["source"] == "web_images"}
    text_heavy = {e["sample_id"] for e in explorer_corpus.planted("text_heavy")}
    assert text_heavy and text_heavy <= set(all_ids(client, label="text"))


def test_group_filter_lists_the_duplicate_group(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    rows = table(explorer_corpus, "duplicates", ["sample_id", "group_id", "keeper"])
    group = max({r["group_id"] for r in rows}, key=lambda g: sum(r["group_id"] == g for r in rows))
    members = {r["sample_id"] for r in rows if r["group_id"] == group}
    assert len(members) >= 2
    assert set(all_ids(client, group=group)) == members


def test_pages_are_disjoint_and_complete(client: TestClient) -> None:
    first, second = search(client), search(client, page="2")
    assert first["total"] > PAGE_SIZE and len(first["rows"]) == PAGE_SIZE
    assert not {r["sample_id"] for r in first["rows"]} & {r["sample_id"] for r in second["rows"]}
    assert search(client, page=str(first["pages"] + 5))["rows"] == []


# -- full-text search ---------------------------------------------------------------------------------

def test_text_search_finds_planted_captions_with_highlights(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    planted = {e["sample_id"] for e in explorer_corpus.manifest if "astronaut" in e["caption"].lower()}
    assert planted
    result = search(client, q="astronaut")
    found = all_ids(client, q="astronaut")
    assert planted <= set(found), "every sample whose original caption says astronaut is found"
    assert result["mode"] == "text"
    for row in result["rows"]:
        assert "astronaut" in (row["caption"] + " " + row["original_caption"]).lower()
    scores = [r["score"] for r in result["rows"]]
    assert scores == sorted(scores, reverse=True)
    html = client.get("/", params={"q": "Astronauts"}).text  # stemmed and case-folded, as Lance's tokenizer does
    assert html.lower().count("<mark>astronaut</mark>") >= len(planted)


def test_text_search_combines_with_filters(client: TestClient) -> None:
    everywhere = set(all_ids(client, q="wallpaper"))
    web = set(all_ids(client, q="wallpaper", source="web_images"))
    assert web and web < everywhere and all(s.startswith("web_images/") for s in web)


@pytest.mark.parametrize("text", ["' OR 1=1 --", "\"unclosed", "caption:(", "a AND", "%", "\\"])
def test_hostile_query_strings_do_not_break_search(client: TestClient, text: str) -> None:
    assert client.get("/", params={"q": text}).status_code == 200
    assert "total" in search(client, q=text)


# -- nearest neighbours ----------------------------------------------------------------------------------

def test_more_like_this_by_caption_ranks_identical_content_first(client: TestClient,
                                                                 explorer_corpus: ExplorerCorpus) -> None:
    copies = [e for e in explorer_corpus.manifest if e.get("role") == "copy"]
    assert copies
    original = next(e for e in explorer_corpus.manifest if e.get("group") == copies[0]["group"] and e.get("role") == "original")
    body = client.get("/api/neighbours", params={"like": original["sample_id"], "by": "caption"}).json()
    assert body["note"] is None
    distances = [n["distance"] for n in body["neighbours"]]
    assert distances == sorted(distances) and distances[0] >= 0.0  # never a rounding's -1e-7 ("-0.000")
    assert original["sample_id"] not in [n["sample_id"] for n in body["neighbours"]]
    nearest = {n["sample_id"]: n["distance"] for n in body["neighbours"]}
    assert nearest[copies[0]["sample_id"]] == pytest.approx(0.0, abs=1e-4), "a byte copy has the same caption"
    page = search(client, like=original["sample_id"])
    assert page["mode"] == "like" and page["rows"][0]["sample_id"] in nearest


def test_more_like_this_by_clip_uses_the_source_embeddings(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    with_clip = {r["sample_id"] for r in table(explorer_corpus, "source_embeddings", ["sample_id"])}
    assert with_clip and all(s.startswith("stock_photos/") for s in with_clip)
    like = sorted(with_clip)[0]
    body = client.get("/api/neighbours", params={"like": like, "by": "clip"}).json()
    assert body["neighbours"] and {n["sample_id"] for n in body["neighbours"]} <= with_clip - {like}
    missing = client.get("/api/neighbours", params={"like": "web_images/nope", "by": "clip"}).json()
    assert missing["neighbours"] == [] and "no sample" in missing["note"]


# -- the detail page ------------------------------------------------------------------------------------

def test_detail_page_shows_captions_label_phash_bucket_crop_and_versions(client: TestClient,
                                                                         explorer_corpus: ExplorerCorpus) -> None:
    [mds] = table(explorer_corpus, "mds_index", ["sample_id", "content_id", "tier", "bucket"], "source = 'stock_photos'")[:1]
    sid = mds["sample_id"]
    [sample] = table(explorer_corpus, "samples", ["width", "height", "original_caption"], f"sample_id = '{sid}'")
    key = source_caption_key(mds["content_id"], sample["original_caption"])  # the demo's captions are its sources'
    [caption] = table(explorer_corpus, "captions", ["caption"], f"content_id = '{key}'")
    [label] = table(explorer_corpus, "caption_labels", ["label"], f"content_id = '{key}'")
    [phash] = table(explorer_corpus, "phashes", ["phash"], f"sample_id = '{sid}'")
    html = client.get("/sample", params={"id": sid}).text
    assert caption["caption"].split()[0] in html and label["label"] in html
    assert "Source caption" in html and "VLM caption" not in html  # named for what made it: no VLM ran
    assert f"{phash['phash']:016x}" in html
    w, _, h = mds["bucket"].partition("x")
    left, top, right, bottom = crop_box(sample["width"], sample["height"], Bucket(mds["tier"], int(w), int(h)))
    [rect] = [a for t, a in parse(html).tags if t == "rect"]
    assert (int(rect["x"]), int(rect["y"]), int(rect["width"]), int(rect["height"])) == (left, top, right - left, bottom - top)
    versions = Storage(str(explorer_corpus.root))
    assert f"samples@{lance_io.table_version(versions.lance_uri('samples'))}" in html


def test_detail_page_marks_the_keeper_among_group_members(client: TestClient) -> None:
    rows = search(client, skipped="duplicate")["rows"]
    assert rows
    html = client.get("/sample", params={"id": rows[0]["sample_id"]}).text
    group = rows[0]["group_id"]
    assert f'href="/?group={group}"' in html
    assert html.count('class="card keeper"') == 1


def test_detail_of_an_ingest_reject_gives_its_reason(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    entry = next(e for e in explorer_corpus.manifest if e["reject"] == "truncated")
    html = client.get("/sample", params={"id": entry["sample_id"]}).text
    assert "truncated at samples" in html and "No image stored" in html
    assert client.get("/thumb", params={"id": entry["sample_id"]}).status_code == 404


# -- thumbnails and plots ------------------------------------------------------------------------------

def test_thumbnails_are_bounded_jpegs_served_from_cache(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    sid = next(e["sample_id"] for e in explorer_corpus.manifest if e["kinds"] == ["photo"])
    cache = client.app.state.explorer.thumbs
    for size in (256, 768):
        first = client.get("/thumb", params={"id": sid, "size": str(size)})
        hits = cache.hits
        second = client.get("/thumb", params={"id": sid, "size": str(size)})
        assert first.content == second.content and cache.hits == hits + 1
        image = Image.open(io.BytesIO(first.content))
        assert image.format == "JPEG" and max(image.size) <= size
    assert client.get("/thumb", params={"id": sid, "size": "4096"}).status_code == 400  # not a thumbnail size


def test_overview_counts_and_plots(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    html = client.get("/overview").text
    for source in ("stock_photos", "web_images"):
        rows = len([e for e in explorer_corpus.manifest if e["source"] == source])
        assert f">{source}</a></td><td>{rows}</td>" in html
    images = [a["src"] for t, a in parse(html).tags if t == "img"]
    assert len(images) == 5
    for src in images:
        response = client.get(src)
        assert response.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(response.content)).size[0] > 400


# -- safety ---------------------------------------------------------------------------------------------

def test_hostile_caption_renders_inert(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    [entry] = explorer_corpus.planted("hostile_caption")
    for html in (client.get("/sample", params={"id": entry["sample_id"]}).text,
                 client.get("/", params={"q": "xsslink"}).text):
        assert "&lt;script&gt;" in html
        tags = parse(html).tags
        assert not [t for t, _ in tags if t == "script"]
        assert not [(t, a) for t, a in tags if any(k.startswith("on") for k in a)]
        assert not [a for _, a in tags if (a.get("href") or "").strip().lower().startswith("javascript:")]
        assert not [a for t, a in tags if t == "img" and a.get("src") == "x"]


def test_security_headers_and_read_only(client: TestClient) -> None:
    response = client.get("/")
    assert "script-src" not in response.headers["content-security-policy"]  # default-src 'none' forbids scripts
    assert response.headers["content-security-policy"].startswith("default-src 'none'")
    assert response.headers["x-content-type-options"] == "nosniff"
    for path in ("/", "/thumb", "/api/search"):  # a page elsewhere cannot probe an id through a thumbnail
        assert client.get(path, params={"id": "x"}).headers["cross-origin-resource-policy"] == "same-origin"
    for path in ("/", "/sample", "/thumb", "/api/search"):
        assert client.post(path).status_code == 405
        assert client.delete(path).status_code == 405


@pytest.mark.parametrize("sample_id", ["../../../../etc/passwd", "/etc/passwd", "stock_photos/../../lance",
                                       "' OR '1'='1", "%00"])
def test_request_values_never_reach_paths_or_sql(client: TestClient, sample_id: str) -> None:
    assert client.get("/sample", params={"id": sample_id}).status_code == 404
    assert client.get("/thumb", params={"id": sample_id}).status_code == 404
    assert search(client, like=sample_id)["total"] == 0
    assert client.get("/plot/../../etc/passwd.png").status_code == 404


# -- freshness -----------------------------------------------------------------------------------------

def test_a_new_explorer_version_shows_without_restart(explorer_corpus: ExplorerCorpus, tmp_path, monkeypatch) -> None:
    """Pages keep the old view while a background refresh reopens the tables, then show the new
    `explorer` version; a failed refresh keeps the old view and says why on /healthz. Pages read
    the `explorer` table (which its asset rewrites when an upstream table moves), so the change
    is made there: deleting a `samples` row shows once `explorer` is rematerialized."""
    import shutil

    import lance

    from prx_explorer import view as view_module
    from prx_explorer.app import create_app

    shutil.copytree(explorer_corpus.root / "lance", tmp_path / "lance")
    client = TestClient(create_app(Storage(str(tmp_path)), ttl=0.0), base_url="http://localhost")
    views = client.app.state.explorer.views
    before = search(client)["total"]
    victim = search(client, source="web_images")["rows"][0]["sample_id"]
    uri = Storage(str(tmp_path)).lance_uri("explorer")
    assert wait_for(lambda: not views.status()["refreshing"])  # the refreshes those requests began are done
    lance.dataset(uri).delete(f"sample_id = {lance_io.sql_literal(victim)}")
    assert search(client)["total"] == before  # served at once from the old view; the refresh has started
    assert wait_for(lambda: search(client)["total"] == before - 1)
    assert client.get("/sample", params={"id": victim}).status_code == 404
    health = client.get("/healthz").json()
    assert health["versions"]["explorer"] == lance.dataset(uri).version and health["refresh_error"] is None

    def broken(storage: Storage, previous: object = None) -> None:
        raise OSError("object store unreachable")

    monkeypatch.setattr(view_module, "open_view", broken)
    lance.dataset(uri).delete(f"source = {lance_io.sql_literal('web_images')}")
    assert wait_for(lambda: "OSError" in (client.get("/healthz").json()["refresh_error"] or ""))  # not its text
    assert search(client)["total"] == before - 1  # still the last good view
    monkeypatch.undo()
    assert wait_for(lambda: client.get("/healthz").json()["versions"]["explorer"] == lance.dataset(uri).version)
    assert client.get("/healthz").json()["refresh_error"] is None
    stock = len([e for e in explorer_corpus.manifest if e["source"] == "stock_photos"])
    assert search(client)["total"] == stock  # web_images' rows (its ingest rejects too) are gone


def wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_browse_refuses_a_root_without_a_corpus(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).with_name("prx-corpus"))
    done = subprocess.run([cli, "browse", "--root", str(tmp_path / "nothing")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "error: no corpus at" in done.stderr and "prx-corpus build" in done.stderr
