"""Hostile requests to the explorer: malformed query values are a 400 naming the parameter (never
a 500), and a request whose Host is not on the allow-list (DNS rebinding) is refused."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from prx_core.store.storage import Storage
from prx_explorer.app import create_app

CLI = str(Path(sys.executable).with_name("prx-corpus"))
SEARCH_ROUTES = ("/", "/api/search")
# Numeric or enum parameters of each route, and values each must refuse with a 400.
NUMERIC = [("/", "page"), ("/", "tier"), ("/api/search", "page"), ("/api/search", "tier"), ("/thumb", "size"),
           ("/sample", "group_page")]
ENUM = [("/", "by"), ("/api/search", "by"), ("/api/neighbours", "by")]
TEXT = [(route, name) for route in SEARCH_ROUTES for name in ("q", "like", "source", "label", "bucket", "group",
                                                               "skipped", "rejected", "meta")] + [
    ("/api/neighbours", "like"), ("/sample", "id"), ("/thumb", "id")]
BAD_NUMBERS = ["²", "١٢", "１", "5" * 5000, "9" * 20, "-1", "0", "+1", "1.5", "1e3", "0x10", "NaN", "inf", "1 2",
               "abc", "\x00"]
BAD_TEXT = ["x" * 5000, "a\x00b", "line\nbreak", "\x1b[31m"]
NO_PARAMS = ("/overview", "/healthz", "/plot/resolution.png", "/style.css")
ALL_NAMES = sorted({n for _, n in NUMERIC + ENUM + TEXT} | {"id", "x"})
ALL_ROUTES = sorted({r for r, _ in NUMERIC + ENUM + TEXT} | set(NO_PARAMS))


@pytest.fixture(scope="module")
def lenient(small_corpus: Storage) -> TestClient:
    """A client that returns a server error as a 500 response, as a browser would see it."""
    return TestClient(create_app(small_corpus), base_url="http://localhost", raise_server_exceptions=False)


def assert_refused(response, name: str) -> None:
    assert response.status_code == 400, (name, response.status_code, response.text[:300])
    assert name in response.text


@pytest.mark.parametrize("route,name", NUMERIC + ENUM)
def test_malformed_numbers_and_choices_are_a_400_naming_the_parameter(lenient: TestClient, route: str,
                                                                      name: str) -> None:
    extra = {"by": ["clipx", "CAPTION", "caption,clip"], "size": ["512", "4096"]}.get(name, [])
    for value in BAD_NUMBERS + extra:
        params = {"id": "stock_photos/whatever", name: value} if route in ("/thumb", "/sample") else {name: value}
        assert_refused(lenient.get(route, params=params), name)


@pytest.mark.parametrize("route,name", TEXT)
def test_overlong_or_control_character_text_is_a_400(lenient: TestClient, route: str, name: str) -> None:
    for value in BAD_TEXT:
        assert_refused(lenient.get(route, params={name: value}), name)


def test_good_values_still_work(lenient: TestClient) -> None:
    assert lenient.get("/api/search", params={"page": "2", "tier": "1024", "by": "clip"}).status_code == 200
    assert lenient.get("/", params={"page": "", "tier": "", "q": "astronaut"}).status_code == 200  # "" is "any"
    assert lenient.get("/api/search", params={"page": " 3 "}).json()["page"] == 3


def test_400s_are_json_on_the_api_and_a_page_elsewhere(lenient: TestClient) -> None:
    api = lenient.get("/api/search", params={"page": "²"})
    assert api.headers["content-type"].startswith("application/json") and "page" in api.json()["error"]
    html = lenient.get("/", params={"page": "²"})
    assert html.headers["content-type"].startswith("text/html") and "<footer>" in html.text
    assert html.headers["content-security-policy"].startswith("default-src 'none'")
    assert "5555555555" not in lenient.get("/", params={"page": "5" * 5000}).text  # the value is not echoed back


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ALL_ROUTES),
       params=st.dictionaries(st.sampled_from(ALL_NAMES),
                              st.one_of(st.text(max_size=30), st.text("0123456789²³¹١٢１-+. ", max_size=12),
                                        st.integers().map(str), st.sampled_from(BAD_NUMBERS + BAD_TEXT)),
                              max_size=4))
def test_no_query_value_is_a_server_error(lenient: TestClient, route: str, params: dict[str, str]) -> None:
    response = lenient.get(route, params=params)
    assert response.status_code in (200, 400, 404), (route, params, response.status_code, response.text[:300])


# -- the Host allow-list (DNS rebinding) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_root(small_corpus: Storage) -> Path:
    return Path(small_corpus.root)


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "127.0.0.1.nip.io", "localhost.evil",
                                  "evil.localhost", "0.0.0.0", "[::2]", "", "exa mple"])
def test_a_foreign_host_is_refused(small_root: Path, host: str) -> None:
    client = TestClient(create_app(Storage(str(small_root))), base_url="http://localhost")
    for path in ("/", "/healthz", "/api/search", "/sample?id=tiny/000"):
        response = client.get(path, headers={"host": host})
        assert response.status_code == 400, (path, host, response.text)
        assert "tiny/000" not in response.text


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:9", "[::1]", "[::1]:8080",
                                  "LOCALHOST"])
def test_loopback_hosts_are_allowed_by_default(small_root: Path, host: str) -> None:
    client = TestClient(create_app(Storage(str(small_root))), base_url="http://localhost")
    assert client.get("/healthz", headers={"host": host}).json()["rows"] == 40


def test_extra_hosts_are_allowed_when_configured(small_root: Path) -> None:
    client = TestClient(create_app(Storage(str(small_root)), allowed_hosts=["explorer.internal", "*.corp.example"]))
    assert client.get("/healthz", headers={"host": "explorer.internal:8080"}).status_code == 200
    assert client.get("/healthz", headers={"host": "a.corp.example"}).status_code == 200
    assert client.get("/healthz", headers={"host": "localhost"}).status_code == 200  # loopback names stay allowed
    assert client.get("/healthz", headers={"host": "attacker.example"}).status_code == 400


@pytest.mark.parametrize("host", ["explorer.internal:8080", "http://x", "a b", "*x.example", "a.*.example", "", "u@x"])
def test_a_malformed_allowed_host_is_refused_at_start(small_root: Path, host: str) -> None:
    with pytest.raises(ValueError, match="allowed host"):
        create_app(Storage(str(small_root)), allowed_hosts=[host])


def test_an_ipv6_bind_address_is_allowed_as_a_host(small_root: Path) -> None:
    client = TestClient(create_app(Storage(str(small_root)), allowed_hosts=["fd00::5", "[fd00::6]"]))
    assert client.get("/healthz", headers={"host": "[fd00::5]:8080"}).status_code == 200
    assert client.get("/healthz", headers={"host": "[fd00::6]"}).status_code == 200


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(small_root: Path) -> Iterator[int]:
    """`prx-corpus browse` on its default bind (127.0.0.1) with one extra allowed host."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PRX_CONFIG"}
    process = subprocess.Popen([CLI, "browse", "--root", str(small_root), "--port", str(port),
                                "--allow-host", "explorer.test"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env)
    deadline = time.monotonic() + 90
    while get(port, "127.0.0.1:%d" % port) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"prx-corpus browse did not start:\n{process.stdout.read().decode()}")
        time.sleep(0.3)
    yield port
    process.terminate()
    process.wait(timeout=10)


def get(port: int, host: str) -> int | None:
    """The status of GET /healthz sent to the loopback port with this Host header (None: not up)."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.putrequest("GET", "/healthz", skip_host=True)
        connection.putheader("Host", host)
        connection.endheaders()
        status = connection.getresponse().status
        connection.close()
        return status
    except OSError:
        return None


def test_the_cli_serves_loopback_and_configured_hosts_only(served: int) -> None:
    assert get(served, f"127.0.0.1:{served}") == 200
    assert get(served, f"localhost:{served}") == 200
    assert get(served, "explorer.test") == 200
    assert get(served, f"rebound.attacker.example:{served}") == 400


def test_the_cli_server_sends_no_store_and_answers_phrases(served: int) -> None:
    import json

    for path in ("/", "/api/search?q=%22cat%20photo%22", "/healthz", "/api/search?page=0"):
        connection = http.client.HTTPConnection("127.0.0.1", served, timeout=30)
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        connection.close()
        assert response.getheader("Cache-Control") == "no-store", path
        assert response.status == (400 if "page=0" in path else 200), path
        if "cat" in path:
            answer = json.loads(body)
            assert answer["notes"] == [] and answer["total"] == 8  # "a cat photo": every fifth of 40 samples
