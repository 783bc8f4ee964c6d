"""`prx-corpus browse`: a read-only, server-rendered explorer over the corpus's Lance tables.

Every request is a bounded query over the `explorer` table and its facet counts (`view`), never
a whole-table read; a corpus without them shows one line saying so and how to build them.

Starlette + Jinja2 with autoescaping and no JavaScript at all; a Content-Security-Policy that
forbids scripts backs that up, so an untrusted caption can neither run nor load anything. Every
route is GET; request values are only lookup keys and quoted SQL literals, checked first
(`params`: a malformed one is a 400). Requests must name an allowed Host (loopback names by
default): a page elsewhere cannot read a loopback explorer by rebinding its own DNS name to it.
Pages and JSON are never cached (`Cache-Control: no-store`), and no page or answer carries an
exception's text: a failure is logged, the client gets a fixed message.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from prx_core.store.lance_io import sql_literal
from prx_core.store.storage import Storage
from prx_explorer import plots
from prx_explorer.disk_cache import DiskThumbnails
from prx_explorer.facets import MENUS, facet_rows, totals
from prx_explorer.metadata import sample_details
from prx_explorer.params import BadRequest, int_param, text_param
from prx_explorer.previews import preview_runs, preview_thumbnail
from prx_explorer.query import MAX_PAGE, Query
from prx_explorer.render import THUMB_SIZES, ThumbnailCache, crop_rect, highlight, query_terms, snippet
from prx_explorer.search import NeighbourCache, QueryCache, run_query
from prx_explorer.scans import RETRY_AFTER, Busy, ScanSlots
from prx_explorer.thumbnails import BUSY_TEXT, REFUSED, ThumbnailRenders, placeholder, render_thumbnail
from prx_explorer.view import View, ViewCache, one_row

HERE = Path(__file__).parent
STYLESHEET = (HERE / "templates" / "style.css").read_text()  # served from memory: no request maps to a file
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src 'self'; style-src 'self'; form-action 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # another site's page cannot load a thumbnail or page of the corpus (it could tell an id is there)
    "Cross-Origin-Resource-Policy": "same-origin",
}
NO_STORE = ("text/html", "application/json")  # always `no-store`; other responses without a policy get it too
SERVER_ERROR = "Internal error; the details are in the explorer log."
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
GROUP_PAGE = 100  # duplicate-group members per detail page: a group can hold thousands


log = logging.getLogger(__name__)


class SecurityHeaders(BaseHTTPMiddleware):
    """The security headers and the cache policy on every response; an unhandled failure is
    logged and answered with a fixed 500 (never a traceback or an exception's text)."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        try:
            response = await call_next(request)
        except Exception:
            log.exception("GET %s failed", request.url.path)
            response = PlainTextResponse(SERVER_ERROR, 500)
        response.headers.update(SECURITY_HEADERS)
        kind = response.headers.get("content-type", "").split(";")[0].strip()
        if kind in NO_STORE or "cache-control" not in response.headers:
            response.headers["Cache-Control"] = "no-store"
        return response


def _intish(value: Any) -> str:
    if not _present(value):
        return ""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _present(value: Any) -> bool:
    return not (value is None or (isinstance(value, float) and math.isnan(value)) or value == "")


def _templates() -> Jinja2Templates:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
    env.filters["intish"] = _intish
    env.tests["present"] = _present
    return Jinja2Templates(env=env)


class Explorer:
    """The routes over one corpus root; holds the view, thumbnail and plot caches."""

    def __init__(self, storage: Storage, ttl: float = 5.0, thumbnails: DiskThumbnails | None = None) -> None:
        self.storage = storage
        self.views = ViewCache(storage, ttl)
        self.thumbs = ThumbnailCache(disk=thumbnails)
        self.renders = ThumbnailRenders(self.thumbs)
        self.nearest = NeighbourCache()
        self.queries = QueryCache(nearest=self.nearest)
        self.scans = ScanSlots()
        self.templates = _templates()
        self._plots: dict[tuple[int, str], bytes] = {}
        self._plot_lock = threading.Lock()

    def _page(self, request: Request, name: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
        view = context.get("view") or self.views.get()
        base = {"root": self.storage.root, "view": view, "filters": MENUS}
        return self.templates.TemplateResponse(request, name, {**base, **context}, status_code=status)

    def _missing(self, request: Request, view: View) -> HTMLResponse:
        """The one-line page of a corpus without the explorer's tables: what is missing, and the fix."""
        return self._page(request, "error.html", {"view": view, "message": view.missing})

    def index(self, request: Request) -> HTMLResponse:
        view = self.views.get()
        query = Query.from_params(request.query_params)
        with self.scans.slot():
            results = run_query(view, query, self.queries)
        terms = query_terms(query.q)
        cards = [{**row, "snippet": snippet(row["caption"] or row["original_caption"], terms)} for row in results.rows]
        return self._page(request, "index.html", {"view": view, "query": query, "results": results, "cards": cards})

    def api_search(self, request: Request) -> JSONResponse:
        """The same search as JSON, for scripts and tests (captions are data here, not markup)."""
        query = Query.from_params(request.query_params)
        with self.scans.slot():
            results = run_query(self.views.get(), query, self.queries)
        columns = ["sample_id", "source", "label", "tier", "bucket", "group_id", "skip_reason", "reject_reason",
                   "meta_label", "caption", "original_caption", "captioner_id", "caption_verdict", "caption_problem",
                   "word_count"] + (["score"] if results.mode != "browse" else [])
        rows = [{c: row.get(c) for c in columns} for row in results.rows]
        return JSONResponse({"total": results.total, "page": results.query.page, "pages": results.pages,
                             "mode": results.mode, "notes": results.notes, "rows": rows, "facets": results.facets,
                             "menus_count": results.menus_count})

    def sample(self, request: Request) -> HTMLResponse:
        sample_id = text_param(request.query_params, "id")
        group_page = int_param(request.query_params, "group_page", 1, 1, MAX_PAGE) or 1
        view = self.views.get()
        if view.missing:
            return self._missing(request, view)
        row = one_row(view.table("explorer"), "sample_id", sample_id)  # a BTREE lookup
        if row is None:
            return self._page(request, "error.html", {"message": f"No sample {sample_id!r} in this corpus."}, 404)
        group, total, start = [], 0, (group_page - 1) * GROUP_PAGE
        if _present(row.get("group_id")):
            with self.scans.slot():
                group, total = group_members(view, row["group_id"], start)
        clip = one_row(view.table("source_embeddings"), "sample_id", sample_id, ["sample_id"]) is not None
        return self._page(request, "sample.html", {
            "view": view, "row": row, "group": group, "has_clip": clip,
            "group_total": total, "group_page": group_page, "group_start": start,
            "group_pages": max(1, math.ceil(total / GROUP_PAGE)),
            "crop": crop_rect(row.get("width"), row.get("height"), row.get("bucket"), _tier(row.get("tier"))),
            "caption_html": highlight(row["caption"], set()), "original_html": highlight(row["original_caption"], set()),
            "details": sample_details(view, sample_id),
        })

    def thumbnail(self, request: Request) -> Response:
        sample_id = text_param(request.query_params, "id")
        size = int_param(request.query_params, "size", THUMB_SIZES[0], 1, max(THUMB_SIZES))
        if size not in THUMB_SIZES:
            raise BadRequest("size", "must be one of " + ", ".join(map(str, THUMB_SIZES)))
        view = self.views.get()
        if view.missing:
            return PlainTextResponse(view.missing, 404)
        row = one_row(view.table("explorer"), "sample_id", sample_id, ["content_id", "stored"])
        if row is None:
            return Response("not found", 404, media_type="text/plain")
        if view.table("samples") is None or not row["stored"]:
            return Response("no image", 404, media_type="text/plain")  # an ingest reject: its bytes were never stored
        try:
            data = self.renders.get((f"{row['content_id']}", size), lambda: render_thumbnail(view, sample_id, size))
        except Busy:
            return Response(placeholder(size, BUSY_TEXT), 503, media_type="image/jpeg",  # a browser shows it
                            headers={"Retry-After": RETRY_AFTER, "X-Thumbnail": "busy"})
        if data == REFUSED:  # did not decode (within the thumbnail budget): a placeholder, not an error
            return Response(placeholder(size), media_type="image/jpeg", headers={"X-Thumbnail": "placeholder"})
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})

    def overview(self, request: Request) -> HTMLResponse:
        view = self.views.get()
        if view.missing:
            return self._missing(request, view)
        return self._page(request, "overview.html", {"view": view, "plots": plots.PLOTS, "per_source": totals(view)})

    def plot(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in plots.PLOTS:
            return Response("not found", 404, media_type="text/plain")
        view = self.views.get()
        key = (view.serial, name)
        with self._plot_lock:  # matplotlib's pyplot state is global: one figure at a time
            if key not in self._plots:
                self._plots = {k: v for k, v in self._plots.items() if k[0] == view.serial}
                self._plots[key] = plots.PLOTS[name][1](facet_rows(view).to_pylist())
            data = self._plots[key]
        return Response(data, media_type="image/png", headers={"Cache-Control": "no-cache"})

    def previews(self, request: Request) -> HTMLResponse:
        """What `prx-corpus preview` saw (prx_explorer.previews): every source's latest, or one source's runs."""
        source = text_param(request.query_params, "source")
        return self._page(request, "previews.html", {"runs": preview_runs(self.storage, source or None), "source": source})

    def preview_thumb(self, request: Request) -> Response:
        data = preview_thumbnail(self.storage, text_param(request.query_params, "id"),
                                 int_param(request.query_params, "n", 0, 0, 100_000) or 0)
        if data is None:
            return Response("not found", 404, media_type="text/plain")
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})

    def stylesheet(self, request: Request) -> Response:
        return Response(STYLESHEET, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    def health(self, request: Request) -> JSONResponse:
        view = self.views.get()
        return JSONResponse({"root": self.storage.root, "rows": view.rows, "versions": view.versions,
                             "missing": view.missing, "captioner_version": view.captioner_version,
                             **self.views.status(), "thumbnails": self.renders.stats(), "scans": self.scans.stats()})

    def more_like(self, request: Request) -> JSONResponse:
        """Nearest neighbours of one sample as JSON (ids and cosine distances)."""
        query = Query.from_params(request.query_params)
        view = self.views.get()
        with self.scans.slot():
            distances, note = self.nearest.get(view, query.like, query.by) if not view.missing else ({}, view.missing)
        return JSONResponse({"like": query.like, "by": query.by, "note": note,
                             "neighbours": [{"sample_id": k, "distance": float(v)} for k, v in distances.items()]})

    def busy(self, request: Request, exc: Exception) -> Response:
        """Every scan slot stayed taken (prx_explorer.scans): 503 with Retry-After, JSON on the API."""
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": RETRY_AFTER})
        response = self._page(request, "error.html", {"message": str(exc)}, 503)
        response.headers["Retry-After"] = RETRY_AFTER  # no-store: SecurityHeaders, as on every page
        return response

    def refuse(self, request: Request, exc: Exception) -> Response:
        """A malformed query value: JSON on the API, text for images, a page elsewhere (value not echoed)."""
        message = str(exc)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, 400)
        if request.url.path == "/thumb":
            return PlainTextResponse(message, 400)
        return self._page(request, "error.html", {"message": message}, 400)


def group_members(view: View, group_id: str, start: int) -> tuple[list[dict], int]:
    """One page of a duplicate group's members (GROUP_PAGE from `start`, keepers first, then in
    table order) and the group's size: a group can hold thousands, a page reads its members only."""
    explorer, group = view.table("explorer"), f"group_id = {sql_literal(group_id)}"
    columns = ["sample_id", "keeper", "width", "height"] + [  # how far each is from its keeper, where recorded
        c for c in ("group_distance", "group_signature_distance") if c in explorer.schema.names]
    keepers = explorer.to_table(columns=columns, filter=f"{group} AND keeper").to_pylist()
    others = f"{group} AND (keeper IS NULL OR NOT keeper)"
    shown = keepers[start:start + GROUP_PAGE]
    if len(shown) < GROUP_PAGE:
        shown += explorer.to_table(columns=columns, filter=others, offset=max(0, start - len(keepers)),
                                   limit=GROUP_PAGE - len(shown), scan_in_order=True).to_pylist()
    return shown, len(keepers) + explorer.count_rows(others)


def _tier(value: Any) -> int | None:
    return int(value) if _present(value) else None


def host_patterns(hosts: Iterable[str]) -> list[str]:
    """Host-header patterns for TrustedHostMiddleware: the loopback names plus `hosts` (names,
    addresses, `*.example.com`, or `*` for any), IPv6 literals bracketed as a Host header has them."""
    out = []
    for host in (*LOOPBACK_HOSTS, *hosts):
        host = host.strip().lower().removeprefix("[").removesuffix("]")
        if ":" in host:  # an IPv6 literal, or a name with a port: refused below
            host = f"[{host}]" if _ipv6(host) else host
        wildcard = host.startswith("*") and host != "*" and not host.startswith("*.")
        bad = ("/", " ", "@", "?", "#") + (() if host.startswith("[") else (":",))
        if not host or "*" in host[1:] or wildcard or any(c in host for c in bad):
            raise ValueError(f"allowed host {host!r}: give a host name, an address, *.domain or * (no port or path)")
        out.append(host)
    return list(dict.fromkeys(out))


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def create_app(storage: Storage, ttl: float = 5.0, allowed_hosts: Iterable[str] = (),
               thumbnails: DiskThumbnails | None = None) -> Starlette:
    """The explorer app; requests must carry a Host among the loopback names and `allowed_hosts`.
    `thumbnails`: a disk cache of rendered thumbnails (none: memory only)."""
    explorer = Explorer(storage, ttl, thumbnails)
    routes = [
        Route("/", explorer.index, methods=["GET"]),
        Route("/sample", explorer.sample, methods=["GET"]),
        Route("/thumb", explorer.thumbnail, methods=["GET"]),
        Route("/overview", explorer.overview, methods=["GET"]),
        Route("/previews", explorer.previews, methods=["GET"]),
        Route("/previews/thumb", explorer.preview_thumb, methods=["GET"]),
        Route("/plot/{name}.png", explorer.plot, methods=["GET"]),
        Route("/api/search", explorer.api_search, methods=["GET"]),
        Route("/api/neighbours", explorer.more_like, methods=["GET"]),
        Route("/healthz", explorer.health, methods=["GET"]),
        Route("/style.css", explorer.stylesheet, methods=["GET"]),
    ]
    middleware = [Middleware(SecurityHeaders),  # outermost: refusals carry the headers too
                  Middleware(TrustedHostMiddleware, allowed_hosts=host_patterns(allowed_hosts), www_redirect=False)]
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={BadRequest: explorer.refuse, Busy: explorer.busy})
    app.state.explorer = explorer
    return app
