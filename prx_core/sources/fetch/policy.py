"""What a source's fetches may reach: public http(s) hosts, and its own objects, unless the catalog
opts in.

A URL table is data, often written by someone else (LAION-style tables are scraped), yet its URLs
are fetched from inside the cluster with the workers' network and credentials. By default:

- http(s) only to global addresses: a host resolving to a loopback, private (RFC 1918), link-local
  (169.254/16: cloud metadata), unique-local (fc00::/7) or any other non-global address is
  refused when the connection is made (`GuardedResolver`: the addresses connected to are the ones
  checked, so DNS rebinding does not pass), an IP literal before the request, and so is every
  redirect target; `download.allow_networks` names the non-public networks a source may reach
  (`["10.0.0.0/8"]`, `["*"]` for any);
- object-store URLs (`s3://`, ...) only under the source's own `uri` (its bucket and prefix);
  `download.allow_object_prefixes` names further prefixes (`"*"`: any the credentials reach);
- no local files (`file://` URLs, absolute paths) unless `download.allow_files: true`.

A refused URL is a `url_not_allowed` reject naming what it hit and the setting that allows it.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

from prx_core.store.storage import is_remote

HTTP = ("http://", "https://")


class AddressRefused(OSError):
    """Every address a host resolved to is one the source may not reach."""


@dataclass(frozen=True)
class FetchPolicy:
    """A source's fetch rules: its download settings and its own `uri` (None: no source, no objects)."""

    settings: Any
    source_uri: str | None = None

    def refusal(self, url: str) -> str | None:
        """Why `url` may not be fetched (before any request), or None."""
        lower = url[:16].lower()
        if lower.startswith(HTTP):
            return None
        if lower.startswith("file://") or url.startswith("/"):
            if self.settings.allow_files:
                return None
            return "a local file, not fetched (download.allow_files: true allows them for this source)"
        if is_remote(url):
            prefixes = self.object_prefixes()
            if "*" in prefixes or any(url.startswith(p) for p in prefixes):
                return None
            return (f"an object outside the source's {' and '.join(prefixes) or 'uri (not an object store)'}, not "
                    "fetched (download.allow_object_prefixes allows others for this source)")
        return None  # neither: the reader says what it is (a relative path, an unknown scheme)

    def object_prefixes(self) -> list[str]:
        own = [self.source_uri.rstrip("/") + "/"] if self.source_uri and is_remote(self.source_uri) else []
        return own + list(self.settings.allow_object_prefixes)

    def address_refusal(self, host: str) -> str | None:
        """Why an address (an IP literal) may not be connected to, or None (a name: None)."""
        try:
            address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
        except ValueError:
            return None
        address = getattr(address, "ipv4_mapped", None) or address
        if address.is_global and not address.is_multicast:
            return None
        allowed = self.settings.allow_networks
        if "*" in allowed or any(address in ipaddress.ip_network(n, strict=False) for n in allowed
                                 if ipaddress.ip_network(n, strict=False).version == address.version):
            return None
        return (f"{host} is a {kind_of_address(address)} address, not fetched (download.allow_networks allows "
                "non-public networks for this source)")

    def describe(self) -> str:
        """One line for preflight: what this source's fetches may reach."""
        networks = self.settings.allow_networks
        hosts = "any address" if "*" in networks else \
            f"public addresses and {', '.join(networks)}" if networks else "public addresses only"
        prefixes = self.object_prefixes()
        objects = "any object the credentials reach" if "*" in prefixes else \
            f"objects under {', '.join(prefixes)}" if prefixes else "no object-store URLs"
        files = "local files" if self.settings.allow_files else "no local files"
        agents = ", ".join(dict.fromkeys([self.settings.user_agent.split("/", 1)[0].lower(),
                                          *self.settings.opt_out_agents]))
        honour = f"X-Robots-Tag opt-outs for {agents} honoured" if self.settings.honor_opt_out else \
            "X-Robots-Tag opt-outs ignored (honor_opt_out: false)"
        return f"fetches http(s) from {hosts}; {objects}; {files}; {honour}"


def kind_of_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if isinstance(address, ipaddress.IPv6Address) and address in ipaddress.ip_network("fc00::/7"):
        return "unique-local"
    if address.is_private:
        return "private"
    return "non-public"


def guarded_resolver(policy: FetchPolicy) -> Any:
    """An aiohttp resolver that drops the addresses `policy` refuses (all dropped: `AddressRefused`)."""
    from aiohttp.abc import AbstractResolver
    from aiohttp.resolver import ThreadedResolver

    class GuardedResolver(AbstractResolver):
        def __init__(self) -> None:
            self.inner = ThreadedResolver()

        async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
            found = await self.inner.resolve(host, port, family)
            allowed = [r for r in found if policy.address_refusal(r["host"]) is None]
            if found and not allowed:
                raise AddressRefused(policy.address_refusal(found[0]["host"]).replace(
                    found[0]["host"], f"{host} resolves to {found[0]['host']}, which", 1))
            return allowed

        async def close(self) -> None:
            await self.inner.close()

    return GuardedResolver()
