"""``kvstore route serve``: the router as a small HTTP service.

N replicas (vLLM engines, ``kvstore serve`` daemons) publish KV events; a
:class:`~kvstore.route.subscriber.Subscriber` per replica keeps a shared
:class:`~kvstore.route.index.PrefixIndex`, and a
:class:`~kvstore.route.policy.Router` answers:

``POST /route``
    ``{"token_ids": [...]}`` or ``{"text": "..."}`` (text only with a
    tokenizer configured), optional ``"task_id"``, ``"cache_salt"`` and
    ``"tenant"`` -> ``{"replica", "expected_ttft_s", "hit_tokens": {medium:
    tokens}, "reason", "blocks", "n_tokens", "replicas": {name:
    {"expected_ttft_s", "hit_tokens", "load"}}}``.
``GET /replicas``
    per replica: ``blocks`` per medium, ``last_seq``, ``connected``,
    ``load``, ``routed`` and the stream's counters (see SubscriberStatus).
``POST /load``
    ``{"loads": {replica: requests_in_flight}}``: what the load balancer
    reports. A report is used for ``load_ttl_s``; a replica without a
    recent report counts 0 in flight. The service never infers a load from
    the requests it routed, since it never sees them finish; ``routed``
    counts those, separately.

Keys: the router builds the store's block keys from token ids as the
engines do (:func:`kvstore.keys.block_keys` over the replicas' cache
identity, with the request's ``cache_salt``). A daemon publishes its
tenants' keys re-keyed with each tenant's secret (:mod:`kvstore.daemon.tenants`):
given the daemon's key secret file and the tenant names, the router re-keys
with the daemon's own code (:class:`TenantTable`).

Hostile input gets a 4xx JSON ``{"error": kind, "message": ...}`` and the
service goes on: bodies past ``max_body`` (or without a length), bad JSON,
a key given twice, unknown fields, token ids that are not ints in
``[0, 2**32)``, more than ``max_tokens`` tokens. At most ``max_clients``
requests are served at once (the rest get 503).
"""
from __future__ import annotations

import http.server
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.config import ANONYMOUS, DaemonConfig, TenantSpec
from kvstore.config_load import unique_keys
from kvstore.daemon import tenants
from kvstore.daemon.tenants import TenantTable
from kvstore.errors import ConfigError, KVStoreError
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, block_keys
from kvstore.route.index import PrefixIndex
from kvstore.route.policy import Costs, NoReplicas, Router
from kvstore.route.subscriber import ReplicaSpec, Subscriber
from kvstore.units import shown

log = logging.getLogger("kvstore.route")

MAX_BODY = 4 << 20          # bytes of one request body
MAX_TOKENS = 1 << 20        # tokens of one request
MAX_CLIENTS = 64            # requests served at once
REQUEST_FIELDS = ("token_ids", "text", "task_id", "cache_salt", "tenant")
MAX_NAME = 256              # characters of a task id, a salt, a tenant or replica name


class BadRequest(KVStoreError, ValueError):
    """A request the service refuses: its HTTP status and a message for the caller."""

    def __init__(self, message: str, status: int = 400, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def preset_identity(model: str, block_tokens: int) -> CacheIdentity:
    """The identity ``--model PRESET`` routes by: the preset's layers at
    ``block_tokens`` (a hybrid's full-attention group), ``model_id`` the
    preset's name, every other field its default. Clients that build their
    identity this way share its keys; an engine's identity differs (its
    engine name, revisions): give that one as ``--identity FILE``."""
    from kvstore.bench.models import preset  # noqa: PLC0415

    return CacheIdentity.grouped(preset(model).groups(block_tokens), model_id=model)


def read_key_secret(path: str) -> bytes:
    """The daemon's key secret from ``path`` (its state directory's
    ``daemon.secret``, or a file holding ``daemon.key_secret``), read as the
    daemon reads it: a private regular file of this user."""
    try:
        return tenants.read_key_secret(path)
    except OSError as exc:
        raise ConfigError(f"key secret file {path}: {exc.strerror or exc}") from None


class KeySpace:
    """Token ids -> the keys a replica's events name: the chained block keys
    of ``identity`` (with the request's salt), re-keyed for a daemon's tenant
    when a key secret is given. ``tenants``: the names requests may name
    (the first is the default); none with a secret: the anonymous tenant."""

    def __init__(self, identity: CacheIdentity, key_secret: bytes | None = None,
                 tenants: Sequence[str] = ()) -> None:
        self.identity = identity
        self.rekey: dict[str, Any] = {}
        if key_secret is None:
            if tenants:
                raise ConfigError("--tenant needs --key-secret-file: a tenant's keys derive from the "
                                  "daemon's key secret")
            return
        for name in tenants or (ANONYMOUS,):
            if name in self.rekey:
                raise ConfigError(f"--tenant {name} given twice")
            # the daemon's own table derives the secret: one tenant per table,
            # since the anonymous tenant cannot sit beside named ones (the
            # token is only the table's entry ticket, never used)
            conf = DaemonConfig() if name == ANONYMOUS else \
                DaemonConfig(tenants=(TenantSpec(name=name, token=secrets.token_hex(16)),))
            self.rekey[name] = TenantTable(conf, key_secret).by_name[name].server_key

    @property
    def tenants(self) -> list[str]:
        return list(self.rekey)

    def keys(self, tokens: Sequence[int], *, cache_salt: str = "", tenant: str | None = None) -> list[BlockKey]:
        ident = self.identity if cache_salt == self.identity.cache_salt else \
            self.identity.replace(cache_salt=cache_salt)
        keys = block_keys(ident, tokens)
        if not self.rekey:
            if tenant is not None:
                raise BadRequest("this router re-keys for no tenant (it was started without "
                                 "--key-secret-file): leave \"tenant\" out", kind="unknown_tenant")
            return keys
        name = self.tenants[0] if tenant is None else tenant
        server_key = self.rekey.get(name)
        if server_key is None:
            raise BadRequest(f"unknown tenant {shown(name)}; this router knows {self.tenants}",
                             kind="unknown_tenant")
        return [server_key(k) for k in keys]


class Tokenizer:
    """A Hugging Face tokenizer from a local directory, encoding as vLLM's
    completions endpoint does (special tokens added). One call at a time."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer  # noqa: PLC0415
        except ImportError as exc:
            raise ConfigError(f"--tokenizer needs transformers ({exc})") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer there ({exc})"[:400]) from None
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tok.encode(text))


@dataclass
class ServiceConfig:
    replicas: list[ReplicaSpec]
    keyspace: KeySpace
    costs: Costs
    route: str = "prefix"
    tokenizer: Tokenizer | None = None
    shared: tuple[str, ...] = ()        # replicas whose blocks count for every one (a shared L3)
    max_body: int = MAX_BODY
    max_tokens: int = MAX_TOKENS
    max_clients: int = MAX_CLIENTS
    load_ttl_s: float = 30.0
    subscriber: dict[str, Any] = field(default_factory=dict)   # Subscriber keyword arguments

    def __post_init__(self) -> None:
        names = [r.name for r in self.replicas]
        if not names:
            raise ConfigError("give at least one --replica NAME=tcp://HOST:PORT")
        if len(set(names)) != len(names):
            raise ConfigError(f"replica names must be unique, got {names}")
        unknown = sorted(set(self.shared) - set(names))
        if unknown:
            raise ConfigError(f"--shared names no replica: {unknown}")


class RouteService:
    """The index, its subscribers and the router, behind one lock."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.index = PrefixIndex(shared=config.shared)
        self.router = Router(self.index, config.costs, config.route,
                             block_tokens=config.keyspace.identity.layout.block_tokens)
        self.subscribers = {spec.name: Subscriber(spec, self.index, self.lock, **config.subscriber)
                            for spec in config.replicas}
        self._loads: dict[str, tuple[float, float]] = {}     # replica -> (in flight, reported at)

    def start(self) -> RouteService:
        for s in self.subscribers.values():
            s.start()
        return self

    def close(self) -> None:
        for s in self.subscribers.values():
            s.stop()

    # -- the endpoints -------------------------------------------------------------
    def route(self, body: object) -> dict[str, Any]:
        req = _fields(body, REQUEST_FIELDS)
        tokens = self._tokens(req)
        task = _name(req, "task_id")
        salt = _name(req, "cache_salt") or ""
        tenant = _name(req, "tenant")
        try:
            keys = self.config.keyspace.keys(tokens, cache_salt=salt, tenant=tenant)
        except BadRequest:
            raise
        except ConfigError as exc:    # a token id out of range, an identity the salt breaks
            raise BadRequest(str(exc)) from None
        with self.lock:
            load = self._load_now()
            try:
                every = self.router.estimate(keys, len(tokens), load=load)
                choice = self.router.choose(keys, len(tokens), task=task, load=load)
            except NoReplicas:
                raise BadRequest("no replica is connected yet: nothing to route to", 503,
                                 "no_replicas") from None
        return {"replica": choice.replica, "expected_ttft_s": choice.expected_ttft_s,
                "hit_tokens": choice.hit_tokens, "reason": choice.reason, "blocks": len(keys),
                "n_tokens": len(tokens),
                "replicas": {r: {"expected_ttft_s": c.expected_ttft_s, "hit_tokens": c.hit_tokens,
                                 "load": load.get(r, 0.0)} for r, c in every.items()}}

    def replicas(self) -> dict[str, Any]:
        with self.lock:
            load = self._load_now()
            out = {}
            for name, sub in self.subscribers.items():
                status = asdict(sub.status_locked())
                out[name] = {"blocks": self.index.counts(name), "load": load.get(name, 0.0),
                             "load_reported": name in load, "routed": self.router.assigned.get(name, 0),
                             "shared": name in self.index.shared, **status}
        return {"replicas": out, "route": self.router.route,
                "block_tokens": self.router.block_tokens}

    def report_load(self, body: object) -> dict[str, Any]:
        req = _fields(body, ("loads",))
        loads = req.get("loads")
        if not isinstance(loads, dict) or not loads:
            raise BadRequest('a load report is {"loads": {"REPLICA": requests_in_flight, ...}}')
        now = time.monotonic()
        parsed = {}
        for name, n in loads.items():
            if name not in self.subscribers:
                raise BadRequest(f"unknown replica {shown(name)}; known: {sorted(self.subscribers)}",
                                 kind="unknown_replica")
            if not isinstance(n, (int, float)) or isinstance(n, bool) or not 0 <= n <= 1e9:
                raise BadRequest(f"loads.{name} must be a number of requests in flight in [0, 1e9], "
                                 f"got {shown(n)}")
            parsed[name] = (float(n), now)
        with self.lock:
            self._loads.update(parsed)
        return {"ok": True, "loads": {n: v for n, (v, _) in parsed.items()}}

    # -- pieces --------------------------------------------------------------------
    def _tokens(self, req: Mapping[str, Any]) -> list[int]:
        if ("token_ids" in req) == ("text" in req):
            raise BadRequest('give exactly one of "token_ids" (a list of ints) or "text"')
        if "text" in req:
            text = req["text"]
            if not isinstance(text, str):
                raise BadRequest(f'"text" must be a string, got {shown(text)}')
            if self.config.tokenizer is None:
                raise BadRequest('"text" needs a tokenizer, and this router has none (start it with '
                                 '--tokenizer PATH); send "token_ids" instead', kind="no_tokenizer")
            tokens = self.config.tokenizer.encode(text)
        else:
            tokens = req["token_ids"]
            if not isinstance(tokens, list):
                raise BadRequest(f'"token_ids" must be a list of ints, got {shown(tokens)}')
            for i, t in enumerate(tokens):
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 32:
                    raise BadRequest(f"token_ids[{i}] must be an int in [0, 2**32), got {shown(t)}")
        if len(tokens) > self.config.max_tokens:
            raise BadRequest(f"{len(tokens)} tokens is more than this router takes "
                             f"({self.config.max_tokens})", 413, "too_large")
        return tokens

    def _load_now(self) -> dict[str, float]:
        """The reports still fresh (under the lock)."""
        cutoff = time.monotonic() - self.config.load_ttl_s
        return {r: n for r, (n, at) in self._loads.items()
                if at >= cutoff and r in self.index.replicas()}


def _fields(body: object, known: Sequence[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(shown(k, 40) for k in unknown[:5])}; "
                         f"known: {', '.join(known)}", kind="unknown_field")
    return body


def _name(req: Mapping[str, Any], field_name: str) -> str | None:
    value = req.get(field_name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise BadRequest(f'"{field_name}" must be a string of at most {MAX_NAME} characters, '
                         f"got {shown(value)}")
    return value


# -- HTTP ------------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    server: RouteHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 30                     # a client that stalls mid-request loses its connection

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/replicas":
            self._answer(lambda: self.server.service.replicas())
        elif self.path == "/health":
            self._answer(lambda: {"ok": True})
        else:
            self._not_here(("/replicas", "/health"), ("/route", "/load"))

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        routes = {"/route": self.server.service.route, "/load": self.server.service.report_load}
        call = routes.get(self.path)
        if call is None:
            self._not_here(("/route", "/load"), ("/replicas", "/health"))
            return
        try:
            body = self._body()
        except BadRequest as exc:
            self._send(exc.status, {"error": exc.kind, "message": str(exc)}, close=True)
            return
        self._answer(lambda: call(body))

    def _not_here(self, mine: Sequence[str], others: Sequence[str]) -> None:
        if self.path in others:
            self._send(405, {"error": "method_not_allowed",
                             "message": f"{self.command} {self.path} is not served; try the other method"})
        else:
            self._send(404, {"error": "not_found",
                             "message": f"no {self.path[:80]!r}: POST /route, POST /load, GET /replicas"})

    def _body(self) -> object:
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest("send a Content-Length body, not a chunked one", 411, "length_required")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest("a Content-Length is required", 411, "length_required")
        n = int(length)
        if n > self.server.service.config.max_body:
            raise BadRequest(f"body of {n} bytes is more than this router takes "
                             f"({self.server.service.config.max_body})", 413, "too_large")
        raw = self.rfile.read(n)
        if len(raw) != n:
            raise BadRequest("the body ended before its Content-Length", 400, "bad_json")
        try:
            return json.loads(raw, object_pairs_hook=unique_keys)
        except ConfigError as exc:       # a key given twice
            raise BadRequest(str(exc), kind="bad_json") from None
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"the body is not JSON ({type(exc).__name__})", kind="bad_json") from None

    def _answer(self, produce: Any) -> None:
        try:
            out = produce()
        except BadRequest as exc:
            self._send(exc.status, {"error": exc.kind, "message": str(exc)})
        except KVStoreError as exc:
            self._send(400, {"error": type(exc).__name__, "message": str(exc)})
        except Exception as exc:   # noqa: BLE001 - one request's bug must not end the service
            log.exception("route service: %s %s failed", self.command, self.path)
            self._send(500, {"error": "internal", "message": type(exc).__name__})
        else:
            self._send(200, out)

    def _send(self, status: int, body: Mapping[str, Any], close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:                        # the unread body would be read as the next request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        log.debug("route service: " + format, *args)


class RouteHTTPServer(http.server.ThreadingHTTPServer):
    """A thread per request, at most ``max_clients`` at once (the rest get 503)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: RouteService) -> None:
        self.service = service
        self._slots = threading.BoundedSemaphore(service.config.max_clients)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                body = b'{"error": "busy", "message": "too many requests at once; retry"}'
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RouteHTTPServer6(RouteHTTPServer):
    address_family = socket.AF_INET6


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def serve(config: ServiceConfig, listen: tuple[str, int]) -> tuple[RouteService, RouteHTTPServer]:
    """Start the subscribers and bind the HTTP server (not yet serving:
    call ``serve_forever``; ``shutdown`` then ``service.close()`` to end)."""
    service = RouteService(config)
    server = (RouteHTTPServer6 if ":" in listen[0] else RouteHTTPServer)(listen, service)
    service.start()
    return service, server
