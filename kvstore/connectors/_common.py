"""Glue shared by the engine connectors: identity from engine facts, the
connector config, the canonical block payload layout, and a store guard.

Payload layout (one sealed block = one contiguous record, all layers):

    [num_layers, 2 (K, V), block_tokens, num_kv_heads, head_dim]   (MHA/GQA/MQA)
    [num_layers, block_tokens, head_dim]                            (MLA latent)

in the KV dtype, C order. Token-major inside a layer because that is how
paged engines (vLLM's NHD blocks, SGLang's token pools) hold K/V, so a save is
one strided copy per layer. Every connector writes this same order; the
identity still carries the engine name, because two engines' kernels do not
produce bit-identical K/V for the same tokens, and a block may only be
reused where it is bit-for-bit what a fresh prefill computes.

Rejected: one record per layer (8-72 KB fragments; vLLM's offloading got 4-5x
faster moving whole blocks), and storing the engine's native layout
(HND vs NHD) as-is (then the layout would have to enter the key as well).

This module never imports torch, vllm or sglang: it is cheap to import.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import Histogram

from kvstore.config import Config
from kvstore.errors import ConfigError, InvalidHint, KVStoreError, TierUnavailable
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.policies.base import check_followup
from kvstore.stats import LATENCY_BUCKETS
from kvstore.store.driver import followup_of, ops_after, ops_before, send
from kvstore.store.facade import Store, common_stats
from kvstore.units import finite

log = logging.getLogger("kvstore.connectors")
T = TypeVar("T")

# In the engine process's default prometheus-client registry: whatever
# exports that registry (the engine's own /metrics, or start_http_server)
# shows how long its loads and saves took. One histogram for every
# connector, observed where every store call passes (StoreGuard.call).
STORE_CALL_SECONDS = Histogram(
    "kvstore_connector_seconds",
    "Time an engine connector's store call took (load: get, save: put), by connector, call and outcome.",
    ["connector", "op", "outcome"], buckets=LATENCY_BUCKETS)


def engine_logging() -> None:
    """Inside an engine process (whose logging the engine owns): only when
    KVSTORE_LOG_LEVEL is set, give kvstore's loggers a stderr handler at that
    level, once per process. vLLM starts workers as fresh processes, so a
    parent's logging setup never reaches them; the environment does."""
    from kvstore import settings  # noqa: PLC0415

    s, root = settings.load(), logging.getLogger("kvstore")
    if not s.log_level_set or getattr(root, "_kvstore_engine_handler", False):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(s.log_level)
    root._kvstore_engine_handler = True  # type: ignore[attr-defined]  # a mark: installed once

# identity fields a user may set in the connector config; the engine supplies
# the rest (model, layout, dtype, shard) and they cannot be overridden, since a
# wrong layout would make every load garbage.
USER_IDENTITY_FIELDS = (
    "model_id", "model_revision", "tokenizer_id", "tokenizer_revision", "kv_quant",
    "adapter_id", "adapter_revision", "chat_template_revision", "mm_processor_version",
    "cache_salt", "key_hash",
)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What a connector reads from its engine-side config (vLLM's
    ``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``).

    ``store`` and ``policy`` are those sections of the config tree
    (``{"store": {"dram": {"capacity_bytes": "8GiB"}}}``, see the README),
    with the ``KVSTORE_*`` environment variables under them; the whole
    tree is ``tree``. Other keys:
    ``identity`` overrides the user-settable identity fields (revisions, chat
    template, tenant salt); ``save`` / ``load`` turn either direction off;
    ``min_load_blocks`` skips loads too short to beat recomputing them.
    """

    tree: Config
    identity: tuple[tuple[str, str], ...] = ()
    save: bool = True
    load: bool = True
    min_load_blocks: int = 1
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.tree, Config):
            raise ConfigError("tree must be a kvstore.config.Config")
        for name, value in self.identity:
            if name not in USER_IDENTITY_FIELDS:
                raise ConfigError(f"identity field {name!r} cannot be set here; "
                                  f"settable: {', '.join(USER_IDENTITY_FIELDS)}")
            if not isinstance(value, str):
                raise ConfigError(f"identity field {name} must be a string, got {value!r}")
        for name in ("save", "load"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false")
        if not isinstance(self.min_load_blocks, int) or self.min_load_blocks < 1:
            raise ConfigError(f"min_load_blocks must be a positive int, got {self.min_load_blocks!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str | None,
                  known_extra: Sequence[str] = ()) -> ConnectorConfig:
        """Parse a dict (or its JSON text). Unknown keys are errors, except
        ``known_extra`` ones, which the engine-specific connector reads."""
        if data is None:
            data = {}
        if isinstance(data, str):
            from kvstore.config_load import unique_keys  # noqa: PLC0415
            try:
                data = json.loads(data, object_pairs_hook=unique_keys) if data.strip() else {}
            except ConfigError as exc:   # a key given twice
                raise ConfigError(f"connector config: {exc}") from None
            except (ValueError, RecursionError) as exc:
                raise ConfigError(f"connector config is not valid JSON: {type(exc).__name__}") from None
        if not isinstance(data, Mapping):
            raise ConfigError("connector config must be an object")
        data = dict(data)
        mine = ({f.name for f in dataclasses.fields(cls)} - {"extra", "tree"}) | {"store", "policy"}
        extra = {k: data.pop(k) for k in list(data) if k in known_extra}
        unknown = sorted(set(data) - mine)
        if unknown:
            moved = " (now store.remote.url / token / shm / timeout_s)" \
                if any(k.startswith("daemon_") for k in unknown) else ""   # the keys before the tree
            raise ConfigError(f"unknown connector config key(s): {', '.join(unknown)}{moved}; "
                              f"known: {sorted(mine | set(known_extra))}")
        from kvstore.config_load import load_config  # noqa: PLC0415

        tree: dict[str, Any] = {name: data.pop(name) for name in ("store", "policy") if name in data}
        config = load_config(data=tree, env_file=False)   # $KVSTORE_CONFIG describes the daemon
        ident = data.pop("identity", {}) or {}
        if not isinstance(ident, Mapping):
            raise ConfigError("identity must be an object of strings")
        return cls(tree=config, identity=tuple(sorted(ident.items())),
                   extra=tuple(sorted(extra.items())), **data)

    def extra_value(self, name: str, default: Any = None) -> Any:
        return dict(self.extra).get(name, default)


def attention_kind(num_heads: int, num_kv_heads: int, *, mla: bool = False,
                   sliding_window: int | None = None) -> str:
    if mla:
        return "mla"
    if sliding_window:
        return "sliding_window"
    if num_kv_heads == num_heads:
        return "mha"
    return "mqa" if num_kv_heads == 1 else "gqa"


def dtype_name(dtype: object) -> str:
    """'torch.bfloat16' / numpy dtype / str -> the identity's dtype name."""
    text = str(dtype).removeprefix("torch.")
    aliases = {"half": "float16", "float": "float32", "float8_e4m3fn": "fp8_e4m3",
               "float8_e5m2": "fp8_e5m2"}
    return aliases.get(text, text)


def rope_fields(config: object) -> tuple[float, str]:
    """(rope_theta, canonical JSON of the scaling dict) from an HF-style config.

    transformers 5 moved both into ``rope_parameters``; 4.x had ``rope_theta``
    and ``rope_scaling``. Either way the identity gets the same values.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
            scaling = {}
    else:
        theta = float(getattr(config, "rope_theta", 10000.0) or 10000.0)
        scaling = getattr(config, "rope_scaling", None) or {}
    text = json.dumps(scaling, sort_keys=True, separators=(",", ":"), default=str) if scaling else ""
    return theta, text


def build_identity(*, engine: str, model_id: str, layout: KVLayout, user: Mapping[str, str] = {},
                   engine_extra: Mapping[str, str] = {}, **fields: Any) -> CacheIdentity:
    """A CacheIdentity from engine facts (``fields``) plus user overrides.

    Engine facts win over nothing: a user override of an engine-derived field
    such as the LoRA id or the salt is refused by :class:`ConnectorConfig`
    unless it is one of :data:`USER_IDENTITY_FIELDS`; per-request values
    (cache_salt, adapter) are passed in ``fields`` and take precedence.
    """
    values: dict[str, Any] = {"model_id": model_id}
    values.update({k: v for k, v in user.items()})
    values.update({k: v for k, v in fields.items() if v is not None})
    extra = {"engine": engine, **{k: str(v) for k, v in engine_extra.items()}}
    values["extra"] = tuple(sorted(extra.items()))
    return CacheIdentity(layout=layout, **values)


# -- one store per config per process ---------------------------------------------

_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def shared_store(config: Config, opener: Callable[[Config], Store] | None = None) -> Store:
    """The process's store for ``config``, opened on first use.

    Why shared: vLLM builds one connector object for the scheduler and another
    for the worker, in the same process when there is one worker; both must see
    the same DRAM tier or the scheduler would promise blocks the worker cannot
    load. Across processes, sharing needs a persistent or remote tier (NVMe,
    Redis, the daemon). Thread-safe. Stores live until the process exits.
    """
    key = config.model_dump_json()
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            try:
                store = (opener or open_store)(config)
            except Exception as exc:  # noqa: BLE001 - an engine must start without its cache
                log.error("kvstore: cannot open the store (%s: %s); running without it "
                          "(every lookup misses, saves are dropped)", type(exc).__name__, exc)
                store = UnavailableStore(f"{type(exc).__name__}: {exc}")
            _STORES[key] = store
        return store


class UnavailableStore:
    """Stands in for a store that could not be opened: every data call raises
    :class:`TierUnavailable`, which :class:`StoreGuard` turns into a miss.
    It answers the whole :class:`kvstore.store.facade.Store` API by name, so a typo
    in a connector is a type error, not a silent miss."""

    def __init__(self, why: str) -> None:
        self.why = why

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise TierUnavailable(f"store unavailable: {self.why}")

    lookup = put = put_async = get_into = get_views = get = prefetch = _fail
    pin = unpin = invalidate = report_engine = task_session = _fail

    def stats(self) -> dict[str, Any]:
        return {**common_stats(0, {}), "unavailable": self.why}

    def close(self) -> None:
        """Nothing was opened."""

    def __enter__(self) -> UnavailableStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def process_local_tiers(config: Config) -> list[str]:
    """Tiers whose contents another process cannot see (HBM, DRAM; NVMe is
    locked to one process at a time). A daemon-backed store has none."""
    return [name for name in config.store.tiers() if name != "redis"]


def open_store(config: Config) -> Store:
    """The blocking store ``config`` names (in-process, or the daemon's client)."""
    from kvstore.store.factory import open_store as _open
    return _open(config)


class StoreGuard:
    """Runs store calls so a broken or unreachable store degrades to misses.

    An engine must never fail a request because its cache failed: every
    exception from the store is logged (once per kind, then counted) and the
    caller gets ``fallback``. Bad input from the connector itself is a bug and
    is logged the same way rather than raised into the engine's step loop.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors = 0
        self._seen: set[str] = set()

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        started = time.perf_counter()
        try:
            out, outcome = fn(), "ok"
        except Exception as exc:
            self.errors += 1
            self.warn_once(f"store {what}", exc, "treating as a miss")
            out, outcome = fallback, "error"
        STORE_CALL_SECONDS.labels(self.name, what, outcome).observe(time.perf_counter() - started)
        return out

    def warn_once(self, what: str, exc: Exception, then: str) -> None:
        """Log ``exc`` the first time this kind (``what`` + exception class)
        occurs: an error repeated on every request must not flood the log."""
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._seen:
            self._seen.add(kind)
            log.warning("%s: %s failed (%s: %s); %s", self.name, what, type(exc).__name__, exc, then,
                        exc_info=not isinstance(exc, KVStoreError))


# the key of a request's engine-side params (vLLM's ``kv_transfer_params``)
# holding its follow-up hint: see ``PlacementPolicy.on_request``
FOLLOWUP_PARAM = "kvstore_followup"


def request_followup(params: Mapping[str, Any] | None, guard: StoreGuard) -> float | None:
    """The follow-up hint in a request's params, or None if it carries none.

    The value comes from the engine's client, not from the engine: a bad one
    is logged once and ignored (the request is served without the hint),
    never raised into the engine's step loop."""
    if not isinstance(params, Mapping) or params.get(FOLLOWUP_PARAM) is None:
        return None
    try:
        return check_followup(params[FOLLOWUP_PARAM])
    except InvalidHint as exc:
        guard.warn_once(f"request hint {FOLLOWUP_PARAM!r}", exc, "ignoring it")
        return None


# the key of a request's params holding its agent task (kvstore.sessions)
TASK_PARAM = "kvstore_task"
_TASK_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str, "parent": str, "step": (str, int), "tool_s": (int, float), "checkpoint": str,
    "rollback": str, "end": bool}


@dataclass(frozen=True, slots=True)
class TaskHint:
    """A request's place in an agent task: ``{"kvstore_task": {"id", "parent",
    "step", "tool_s", "checkpoint", "rollback", "end"}}``. ``id`` names the
    task; ``parent`` forks it from that task when it is new; ``rollback``
    rolls the task back to a checkpoint before the request; after it,
    the request's sealed blocks are the task's step ``step``, then
    ``checkpoint`` marks the task, ``tool_s`` pauses it for a tool call
    of about that long, and ``end`` ends it."""

    id: str
    step: str
    parent: str | None = None
    tool_s: float | None = None
    checkpoint: str | None = None
    rollback: str | None = None
    end: bool = False

    @property
    def followup(self) -> float | None:
        """The session as the placement's hint: a task that pauses for a tool
        will send its context again, one that ends will not."""
        return followup_of(self.tool_s, self.end)


def request_task(params: Mapping[str, Any] | None, guard: StoreGuard) -> TaskHint | None:
    """The task hint in a request's params; a bad one is logged once and ignored."""
    raw = params.get(TASK_PARAM) if isinstance(params, Mapping) else None
    if raw is None:
        return None
    try:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str) or "step" not in raw:
            raise InvalidHint(f"{TASK_PARAM} must be an object with an 'id' and a 'step'")
        unknown = sorted(str(k)[:32] for k in raw if k not in _TASK_FIELDS)
        if unknown:
            raise InvalidHint(f"{TASK_PARAM}: unknown field(s) {unknown[:8]}")
        for name, v in raw.items():
            kind = _TASK_FIELDS[name]
            if v is not None and (not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool)):
                raise InvalidHint(f"{TASK_PARAM}.{name} has the wrong type")
        from kvstore.sessions.ledger import MAX_TOOL_S, check_task_id  # noqa: PLC0415
        step = str(raw["step"])
        for v in (raw["id"], step, raw.get("parent"), raw.get("checkpoint"), raw.get("rollback")):
            if v is not None:
                check_task_id(v)
        tool_s = raw.get("tool_s")
        if tool_s is not None and not 0 <= finite(tool_s, f"{TASK_PARAM}.tool_s", InvalidHint) < MAX_TOOL_S:
            raise InvalidHint(f"{TASK_PARAM}.tool_s must be seconds in [0, {MAX_TOOL_S:g}), got {tool_s!r}"[:160])
        return TaskHint(raw["id"], step, raw.get("parent"), None if tool_s is None else float(tool_s),
                        raw.get("checkpoint"), raw.get("rollback"), bool(raw.get("end")))
    except (InvalidHint, KVStoreError) as exc:
        guard.warn_once(f"request hint {TASK_PARAM!r}", exc, "ignoring it")
        return None


def task_before(store: Store, hint: TaskHint, guard: StoreGuard) -> None:
    """What a task's request does before its lookup, as the request driver
    sequences it (:func:`~kvstore.store.driver.ops_before`): begin the task
    (fork it from ``parent`` when new), resume it, roll it back when asked.
    Never raises."""
    ops = ops_before(hint.id, parent=hint.parent, rollback=hint.rollback)
    guard.call("task", lambda: send(ops, store.task_session), None)


def task_after(store: Store, hint: TaskHint, keys: Sequence[Any], guard: StoreGuard) -> None:
    """What a task's request does once its blocks are saved
    (:func:`~kvstore.store.driver.ops_after`): append them as the step
    (idempotent by task and step), then checkpoint, end or pause."""
    ops = ops_after(hint.id, step=hint.step, keys=keys, idem=f"step:{hint.step}", checkpoint=hint.checkpoint,
                    tool_s=hint.tool_s, end=hint.end)
    guard.call("task", lambda: send(ops, store.task_session), None)
