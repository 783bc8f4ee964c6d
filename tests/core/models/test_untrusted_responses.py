"""The OpenAI-compatible transport does not trust the server or the network (issue 15, item 8):
response bodies are capped (a bigger one is a per-request failure, read no further), redirects
are not followed, and the API key is never sent over plain http:// to a host that is not
loopback unless `allow_insecure_http`. Against a real http.server on 127.0.0.1 in a thread."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
from jpegs import jpeg

from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.captioning_openai import OpenAICaptioner
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels_llm import OpenAILLMLabeler, error_code
from prx_core.models.openai_http import ChatClient, is_loopback
from prx_resources.models import CaptionerResource, LabelerResource

PHOTO = jpeg(np.full((32, 32, 3), 90, dtype=np.uint8))
HUGE = 64 << 20  # what the hostile server offers to send
CAP = 1 << 20  # what the client accepts in the tests
CHUNK = b"x" * (64 << 10)


def completion(content: str, padding: int = 0) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}}], "padding": "p" * padding}).encode()


class Handler(BaseHTTPRequestHandler):
    """The route is the first path segment: big (an endless-looking 200 without Content-Length),
    declared (a 200 whose Content-Length says 10 GB), error (a 500 with a huge body), padded (a
    valid 2 MB completion), redirect (307 to the other server), ok (a label and a caption)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server: Server = self.server.owner  # type: ignore[attr-defined]
        server.authorizations.append(self.headers.get("Authorization"))
        route = self.path.strip("/").split("/", 1)[0]
        try:
            if route in ("big", "error"):
                self.send_response(200 if route == "big" else 500)
                self.send_header("Connection", "close")
                self.end_headers()
                while server.sent < HUGE:
                    self.wfile.write(CHUNK)
                    server.sent += len(CHUNK)
            elif route == "declared":
                self.send_response(200)
                self.send_header("Content-Length", str(10 << 30))
                self.end_headers()
                self.wfile.write(CHUNK)
                server.sent += len(CHUNK)
            elif route == "redirect":
                self.send_response(307)
                self.send_header("Location", server.redirect_to)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                body = completion("visual", padding=(2 << 20) if route == "padded" else 0)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            server.hung_up = True
        finally:
            server.done.set()


class Server:
    def __init__(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.sent, self.hung_up, self.done = 0, False, threading.Event()
        self.authorizations: list[str | None] = []
        self.redirect_to = ""
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, route: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{route}/v1"

    def reset(self) -> None:
        self.sent, self.hung_up = 0, False
        self.done.clear()
        self.authorizations.clear()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    pair = Server(), Server()
    yield pair
    for server in pair:
        server.httpd.shutdown()
        server.httpd.server_close()


@pytest.fixture
def server(servers: tuple[Server, Server]) -> Server:
    for s in servers:
        s.reset()
    return servers[0]


def captioner(endpoint: str, **fields: object) -> OpenAICaptioner:
    return OpenAICaptioner(CaptionerConfig("openai", model="m", endpoint=endpoint, max_retries=0, timeout_s=20,
                                           **{"max_response_bytes": CAP, **fields}))


def labeler(endpoint: str, **fields: object) -> OpenAILLMLabeler:
    return OpenAILLMLabeler(LabelerConfig(backend="llm", model="m", endpoint=endpoint, max_retries=0, timeout_s=20,
                                          **{"max_response_bytes": CAP, **fields}))


# ----------------------------------------------------------------------------- body cap


def test_an_oversized_body_is_a_failed_request_and_is_not_read_to_the_end(server: Server) -> None:
    [result] = captioner(server.url("big")).caption_batch([PHOTO], [None])
    assert result.reason == "response_too_large" and str(CAP) in result.error
    assert server.done.wait(20) and server.hung_up and server.sent < HUGE // 4  # the client stopped reading
    server.reset()
    [label] = labeler(server.url("big")).label_batch(["a beach"])
    assert label.label == "" and error_code(label.error) == "response_too_large"
    assert server.done.wait(20) and server.sent < HUGE // 4


def test_a_declared_oversized_body_is_refused_before_reading(server: Server) -> None:
    [result] = captioner(server.url("declared")).caption_batch([PHOTO], [None])
    assert result.reason == "response_too_large"


def test_an_error_body_is_cut_and_the_status_kept(server: Server) -> None:
    [result] = captioner(server.url("error")).caption_batch([PHOTO], [None])
    assert result.reason == "http_error" and result.error.startswith("http_error: 500 ") and len(result.error) <= 500
    assert server.done.wait(20) and server.sent < HUGE // 4


def test_bodies_under_the_cap_are_read_whole(server: Server) -> None:
    [result] = captioner(server.url("padded"), max_response_bytes=8 << 20).caption_batch([PHOTO], [None])
    assert result.caption == "visual"
    with pytest.raises(ValueError, match="max_response_bytes"):
        CaptionerConfig("openai", model="m", endpoint=server.url("ok"), max_response_bytes=10)


# ----------------------------------------------------------------------------- the key and the network


def test_redirects_are_not_followed(servers: tuple[Server, Server], server: Server,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    other = servers[1]
    server.redirect_to = other.url("ok") + "/chat/completions"
    monkeypatch.setenv("PRX_TEST_REDIRECT_KEY", "sk-secret")
    [result] = captioner(server.url("redirect"), api_key_env="PRX_TEST_REDIRECT_KEY").caption_batch([PHOTO], [None])
    assert result.reason == "http_error" and result.error.startswith("http_error: 307")
    assert server.authorizations == ["Bearer sk-secret"] and other.authorizations == []  # never sent on


def test_the_key_goes_over_loopback_http(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRX_TEST_LOOP_KEY", "sk-loop")
    [label] = labeler(server.url("ok"), api_key_env="PRX_TEST_LOOP_KEY").label_batch(["a beach"])
    assert label.label == "visual" and server.authorizations == ["Bearer sk-loop"]


REFUSED = ["http://vllm:8000/v1", "http://10.0.0.5/v1", "http://example.com/v1", "http://0.0.0.0:8000/v1",
           "http://127.0.0.1.nip.io/v1", "http://localhost.example.com/v1", "http://[fe80::1]/v1", "HTTP://Example.com/v1"]
ALLOWED = ["http://localhost:8000/v1", "http://LOCALHOST/v1", "http://127.0.0.1:8000/v1", "http://127.9.8.7/v1",
           "http://[::1]:8000/v1", "http://[::ffff:127.0.0.1]/v1", "https://example.com/v1", "https://10.0.0.5/v1"]


@pytest.mark.parametrize("endpoint", REFUSED)
def test_a_key_over_plain_http_to_the_network_is_refused_unless_allowed(endpoint: str) -> None:
    for make in (lambda **f: CaptionerConfig("openai", model="m", endpoint=endpoint, **f),
                 lambda **f: LabelerConfig(backend="llm", model="m", endpoint=endpoint, **f),
                 lambda **f: CaptionerResource(backend="openai", model="m", endpoint=endpoint, **f).config(),
                 lambda **f: LabelerResource(backend="llm", model="m", endpoint=endpoint, **f).config()):
        with pytest.raises(ValueError, match="allow_insecure_http") as refused:
            make(api_key_env="PRX_KEY")
        assert endpoint in str(refused.value) and "PRX_KEY" in str(refused.value)
        make(api_key_env="PRX_KEY", allow_insecure_http=True)  # the operator says this network is trusted
        make()  # no key, nothing to leak
    transport = SimpleNamespace(endpoint=endpoint, api_key_env="PRX_KEY", concurrency=1, timeout_s=1.0, max_retries=0,
                                backoff_s=0.0, max_response_bytes=CAP, allow_insecure_http=False)
    with pytest.raises(ValueError, match="allow_insecure_http"):
        ChatClient(transport)  # the client checks too, whatever built its transport


@pytest.mark.parametrize("endpoint", ALLOWED)
def test_loopback_and_https_endpoints_may_carry_a_key(endpoint: str) -> None:
    CaptionerConfig("openai", model="m", endpoint=endpoint, api_key_env="PRX_KEY")
    LabelerConfig(backend="llm", model="m", endpoint=endpoint, api_key_env="PRX_KEY")


def test_endpoints_must_be_http_urls() -> None:
    for endpoint in ("file:///etc/passwd", "ftp://host/v1", "vllm:8000/v1", "http:///v1"):
        with pytest.raises(ValueError, match="http"):
            CaptionerConfig("openai", model="m", endpoint=endpoint)
    assert not is_loopback("127.0.0.1.evil") and is_loopback("::1") and not is_loopback("")
