"""Who may talk to the gateway: the `Host` and `Origin` checks and CORS for allowed origins.

A local server is reachable by every web page the user opens. Two defences keep pages out:

- DNS rebinding: a page on `evil.example` re-resolves its own name to 127.0.0.1 and so talks to
  this server with `Host: evil.example:8000`. Only the names this server is bound to are
  answered: 127.0.0.1, localhost, [::1], the bound host and `--allow-host` names, each bare or with
  this server's port. Bound to a wildcard (0.0.0.0 or ::), any IP-literal `Host` is answered too
  (a rebinding page always sends its own domain name, never an IP).
- Cross-site requests: a page elsewhere can POST to http://127.0.0.1:8000 (a "simple" request needs
  no preflight). Browsers name the page in `Origin`: a request that carries an `Origin` other
  than this server's own (the web UI at / is same-origin) or an `--allow-origin` one is refused.
  Allowed origins get CORS headers, preflights included.

Refusals are 403 OpenAI error objects that name the header and the flag that would allow it.
Clients that send no `Origin` (curl, SDKs, `verity`) are not browsers and pass that check.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Iterable, Optional

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta"
CORS_EXPOSE = "X-Request-Id, Retry-After"


class Refused(Exception):
    """A request the guard refuses: HTTP 403 with this message and code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


def _bracket(host: str) -> str:
    """An IPv6 literal as it appears in a Host header: [::1]."""
    host = host.strip().lower()
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def split_host(value: str) -> tuple[str, Optional[int]]:
    """`Host` header -> (lowercased name, port or None); ValueError when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(value)
        name, rest = value[: end + 1], value[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(value)
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" in value:
        raise ValueError(value)  # an unbracketed IPv6 literal is not a valid Host
    else:
        name, port = value, None
    if not name or (port is not None and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(value)
    return name, int(port) if port is not None else None


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine only."""
    h = host.strip().lower().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: Optional[str]) -> Optional[str]:
    """The loud warning for a server reachable from other machines without an API key."""
    if is_loopback(host) or api_key:
        return None
    where = "every network interface" if host.strip() in WILDCARD_HOSTS else f"{host}"
    return (f"verity is bound to {where} WITHOUT an API key: anyone who can reach this machine "
            "can use the model and read what it generates. Set --api-key (or VERITY_API_KEY), "
            "or bind to 127.0.0.1 (the default).")


@dataclass
class Guard:
    """The Host/Origin policy of one gateway; `port` is the bound port (known after bind)."""

    bound_host: str = "127.0.0.1"
    port: int = 0
    allow_hosts: Iterable[str] = ()
    allow_origins: Iterable[str] = ()
    _names: frozenset = field(init=False, default=frozenset())
    _origins: frozenset = field(init=False, default=frozenset())
    _wildcard: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        names = set(LOOPBACK_NAMES) | {_bracket(h) for h in self.allow_hosts}
        self._wildcard = self.bound_host.strip() in WILDCARD_HOSTS
        if not self._wildcard:
            names.add(_bracket(self.bound_host))
        self._names = frozenset(names)
        self._origins = frozenset(o.strip().rstrip("/").lower() for o in self.allow_origins)

    def check_host(self, value: Optional[str]) -> None:
        """Refused unless `Host` names this server (a missing Host comes from no browser)."""
        if value is None:
            return
        try:
            name, port = split_host(value)
        except ValueError:
            raise Refused(f"malformed `Host` header `{value[:100]}`", "host_not_allowed") from None
        known = name in self._names or (self._wildcard and _is_ip_literal(name))
        if not known or (port is not None and self.port and port != self.port):
            raise Refused(
                f"`Host: {value[:100]}` is not a name this server answers to (DNS-rebinding protection); "
                f"use one of {', '.join(sorted(self._names))} with port {self.port}, or start it "
                "with --allow-host NAME", "host_not_allowed")

    def origin_allowed(self, origin: str, host: Optional[str]) -> bool:
        o = origin.strip().rstrip("/").lower()
        if "*" in self._origins and o != "null":
            return True
        if o in self._origins:
            return True
        return host is not None and o == f"http://{host.strip().lower()}"  # same origin: the web UI

    def check_origin(self, origin: Optional[str], host: Optional[str]) -> bool:
        """True when the request is cross-origin from an allowed origin (it gets CORS headers);
        False when it carries no Origin or is same-origin; Refused otherwise."""
        if origin is None:
            return False
        if not self.origin_allowed(origin, host):
            raise Refused(
                f"requests from web pages at `Origin: {origin[:100]}` are refused (cross-site request "
                "protection); start the server with --allow-origin ORIGIN to allow that page", "origin_not_allowed")
        o = origin.strip().rstrip("/").lower()
        return host is None or o != f"http://{host.strip().lower()}"


def cors_headers(origin: str, preflight: bool) -> dict:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
               "Access-Control-Expose-Headers": CORS_EXPOSE}
    if preflight:
        headers.update({"Access-Control-Allow-Methods": CORS_METHODS,
                        "Access-Control-Allow-Headers": CORS_HEADERS, "Access-Control-Max-Age": "600"})
    return headers
