"""Runs scripted vLLM engines for tests/connectors/test_vllm.py.

Runs in the vLLM virtualenv (scripts/setup_vllm_env.sh), not under pytest:
``python vllm_driver.py SPEC.json OUT.json``. The spec lists engines, run
one after another; each ``LLM`` starts its own EngineCore process, so every
engine begins with an empty prefix cache and an empty in-process store.

Spec::

    {"model": DIR, "engines": [{"name": str, "connector": {extra config} | null,
      "prefix_caching": bool, "steps": [
        {"op": "generate", "id": str, "tokens": [int], "salt": str | null, "max_tokens": int},
        {"op": "corrupt", "nvme_path": DIR, "record": int},
        {"op": "corrupt_redis", "url": URL, "group_size": int},
        {"op": "info", "id": str},
        {"op": "invalidate_groups", "id": str, "kinds": [str], "salt": str},
        {"op": "tear_loads", "id": str, "kinds": [str], "count": int},
        {"op": "torn", "id": str},
        {"op": "wait", "file": PATH},
        {"op": "abort", "id": str, "tokens": [int], "kv": {...}},
        {"op": "reload_midway", "id": str, "tokens": [int], "lora": {...}, "after_steps": int,
         "reload": {"lora": {...}}}]}]}

``wait`` holds the started engine until the file exists (a test lets a
consumer engine start while its producer runs, then releases it); ``abort``
runs one engine step of a request and aborts it (vLLM's abort path: the
connector sees it finish as FINISHED_ABORTED). ``reload_midway`` runs a
generate step's request for ``after_steps`` engine steps, then loads
``reload``'s adapter into the engine as vLLM's server does on
``load_lora_adapter`` (``add_lora``; with ``load_inplace``, new weights
under the id the request runs with), then runs it to the end. One step is
one engine-core step only where the core runs in the driver's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); elsewhere the reload lands later.

An engine may name its own ``"model"`` directory and extra ``LLM`` arguments
in ``"llm"`` (``{"enable_lora": true, "max_lora_rank": 8}``,
``{"limit_mm_per_prompt": {"image": 1}}``, ...). A generate step may give a
text ``"prompt"`` instead of ``"tokens"``, ``"images"`` (PNG paths) and
``"mm_kwargs"`` (the request's multimodal processor kwargs), and
``"lora": {"name": str, "id": int, "path": DIR, "load_inplace": bool}``
(vLLM's LoRARequest), or ``"embeds": [seed, length, hidden]`` (random
prompt embeddings instead of tokens; the engine needs
``"llm": {"enable_prompt_embeds": true}``); its
output carries the engine's ``"prompt_tokens"`` (placeholders expanded).

A generate step may ask for ``"logprobs": true`` (each output token's
logprob, as ``logprobs``), and carry ``kv_transfer_params`` as ``"kv"``, or
as ``"kv_from": [engine, id]``: the params an earlier engine's output
carried (a prefill leg's answer, as vLLM's proxy forwards it; an engine's
``"params_from"`` names another runner's results file to find it in), updated with
``"kv_patch"`` (a tampered handoff: ``{"kvstore_handoff": {field: value}}``
merges into that object). Its output's params come back as ``"kv"``. An
engine's ``"kv_role"`` is vLLM's (default ``kv_both``); ``"short_name": true`` leaves
``kv_connector_module_path`` out of its config (the plugin entry point resolves the
name). An engine with ``"probe": true`` runs the connector's worker side
with :class:`KVStoreProbe` mixed in, for ``info``
(its groups, whether it declined, whether vLLM kept its hybrid KV cache
manager on), ``invalidate_groups`` (drop the stored records of the
groups of those kinds for one salt: an eviction of exactly those records),
``tear_loads`` (the worker's next ``count`` loads of records of groups of
those kinds find their last record torn, :class:`TornLoads`) and ``torn``
(how many loads were torn so far).

Output: ``{"engines": {name: {id: {"tokens": [...], "cached": int}}}}`` where
``cached`` is vLLM's ``num_cached_tokens`` (local prefix-cache hits plus
tokens loaded by the connector; with ``prefix_caching: false`` only the latter).

Only JSON crosses the process boundary.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def corrupt_record(nvme_path: str, index: int) -> str:
    """Flip one payload byte of the ``index``-th stored record (append order,
    tombstones skipped) in the NVMe tier's segment files: a real torn block."""
    from kvstore.record import FLAG_TOMBSTONE
    from kvstore.tiers.segments import read_framing, scan_segment

    seen = 0
    for name in sorted(n for n in os.listdir(nvme_path) if n.endswith(".seg")):
        path = os.path.join(nvme_path, name)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            framing = read_framing(f.fileno(), size)
            for off, head in scan_segment(f.fileno(), size, framing).records:
                if head.flags & FLAG_TOMBSTONE:
                    continue
                if seen == index:
                    pos = off + framing.head_bytes + head.stored_len // 2
                    f.seek(pos)
                    byte = f.read(1)
                    f.seek(pos)
                    f.write(bytes([byte[0] ^ 0xFF]))
                    return head.key.hex()
                seen += 1
    raise SystemExit(f"no record {index} in {nvme_path} (found {seen})")


def corrupt_redis_group(url: str, group_size: int, prefix: str = "kvs:") -> int:
    """Flip one payload byte of every record of the namespace that holds
    exactly ``group_size`` records (how the test singles out one prompt's
    blocks without knowing the engine's identity). Returns records damaged."""
    import redis

    from kvstore.record import HEADER_BYTES, unpack_header

    client = redis.Redis.from_url(url)
    groups: dict[bytes, list[bytes]] = {}
    for name in client.scan_iter(match=prefix + "*"):
        head = unpack_header(client.getrange(name, 0, HEADER_BYTES - 1))
        groups.setdefault(head.namespace, []).append(name)
    chosen = [names for names in groups.values() if len(names) == group_size]
    if len(chosen) != 1:
        raise SystemExit(f"want one namespace of {group_size} records, have "
                         f"{sorted(len(v) for v in groups.values())}")
    for name in chosen[0]:
        value = bytearray(client.get(name))
        value[HEADER_BYTES + 7] ^= 0xFF
        client.set(name, bytes(value))
    return len(chosen[0])


class TornLoads:
    """Fault injector around the worker connector's store: the next
    ``count`` reads of records of the groups ``groups`` report their last
    record as failing its checksum (a record torn after the lookup found
    it) and hand the connector nothing for it; every other byte comes from
    the real store."""

    def __init__(self, store: Any, groups: set, count: int) -> None:
        self._store = store
        self.groups = groups
        self.left = count
        self.torn = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def get_views(self, identity: Any, keys: list, consume: Any) -> list:
        if self.left <= 0 or (identity.group or 0) not in self.groups or not keys:   # None: a one-group model
            return self._store.get_views(identity, keys, consume)
        from kvstore.outcomes import MissReason

        self.left -= 1
        self.torn += 1
        bad = len(keys) - 1

        def torn(first: int, blocks: Any, reasons: list) -> None:
            reasons = list(reasons)
            if first <= bad < first + len(reasons):
                reasons[bad - first] = MissReason.CORRUPT
            consume(first, blocks, reasons)

        out = list(self._store.get_views(identity, keys, torn))
        out[bad] = MissReason.CORRUPT
        return out


class KVStoreProbe:
    """Mixed into vLLM's worker (``worker_extension_cls``): reads the worker
    side connector in its own process. Answers JSON text."""

    vllm_config: Any      # the worker's (vLLM sets it; an annotation only)

    def kvstore_info(self) -> str:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        plan = conn.plan
        return json.dumps({
            "declined": conn.declined, "kinds": list(plan.kinds),
            "groups": [g.kind for g in plan.groups],
            "layers": [list(g.layers) for g in plan.groups],
            "record_bytes": [g.layout.block_bytes for g in plan.groups],
            "async_loads": getattr(conn, "async_loads", None),
            "hma_disabled": bool(self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)})

    def kvstore_invalidate(self, kinds: list, salt: str) -> str:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvstore.connectors.vllm import request_narrowing

        conn = get_kv_transfer_group()
        dropped = 0
        for g, group in enumerate(conn.plan.groups):
            if group.kind in kinds:
                # the identity a request under this salt has (the connector's own narrowing)
                ident = conn.base.for_group(g)
                dropped += conn.store.invalidate(ident.replace(**request_narrowing(ident.cache_salt, salt, None)))
        return json.dumps(dropped)

    def kvstore_tear_loads(self, kinds: list, count: int) -> str:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        groups = {g for g, group in enumerate(conn.plan.groups) if group.kind in kinds}
        # the worker side's own attribute: the scheduler's lookups still see every record
        conn.store = TornLoads(conn.store, groups, count)
        return json.dumps(sorted(groups))

    def kvstore_torn(self) -> str:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        store = get_kv_transfer_group().store
        return json.dumps(store.torn if isinstance(store, TornLoads) else 0)


def _params(step: dict, previous: dict, params_from: str | None) -> dict | None:
    """A step's kv_transfer_params: its own, or an earlier output's, patched.
    That output is an earlier engine's of this run, else one in the results
    file ``params_from`` (another runner's: the engines of a disaggregated
    pair run in two processes)."""
    if "kv_from" not in step:
        return step.get("kv")
    engine, rid = step["kv_from"]
    if engine not in previous and params_from:
        with open(params_from) as f:
            previous = json.load(f)["engines"]
    params = json.loads(json.dumps(previous[engine][rid]["kv"]))
    for name, value in (step.get("kv_patch") or {}).items():
        if isinstance(value, dict) and isinstance(params.get(name), dict):
            params[name].update(value)
        else:
            params[name] = value
    return params


def _prompt(step: dict) -> dict:
    """A generate step's prompt: token ids, or a text ``prompt`` (which vLLM
    tokenizes; a multimodal prompt names its placeholders in text), with its
    ``images`` (PNG paths, loaded with PIL), ``mm_kwargs`` (the request's
    processor kwargs) and cache salt."""
    if "embeds" in step:           # [seed, length, hidden]: random prompt embeddings, no token ids
        import torch
        seed, length, hidden = step["embeds"]
        gen = torch.Generator().manual_seed(seed)
        prompt: dict = {"prompt_embeds": torch.randn(length, hidden, generator=gen)}
    elif "prompt" in step:
        prompt = {"prompt": step["prompt"]}
    else:
        prompt = {"prompt_token_ids": step["tokens"]}
    if step.get("images"):
        from PIL import Image
        images = [Image.open(p).convert("RGB") for p in step["images"]]
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
    if step.get("mm_kwargs"):
        prompt["mm_processor_kwargs"] = step["mm_kwargs"]
    if step.get("salt"):
        prompt["cache_salt"] = step["salt"]
    return prompt


def _lora(step: dict) -> object | None:
    """A generate step's ``"lora": {"name", "id", "path"}`` as vLLM's LoRARequest."""
    if not step.get("lora"):
        return None
    from vllm.lora.request import LoRARequest
    lora = step["lora"]
    return LoRARequest(lora["name"], lora["id"], lora["path"], load_inplace=bool(lora.get("load_inplace")))


def _reload_midway(engine: Any, step: dict, prompt: dict, params: Any) -> Any:
    """``step``'s request, with ``step["reload"]``'s adapter loaded into the
    engine after ``after_steps`` engine steps; its final output."""
    engine.add_request(step["id"], prompt, params, lora_request=_lora(step))
    final, steps = None, 0
    while engine.has_unfinished_requests():
        if steps == step.get("after_steps", 1):
            engine.add_lora(_lora(step["reload"]))
        for out in engine.step():
            if out.finished:
                final = out
        steps += 1
    if final is None or steps <= step.get("after_steps", 1):
        raise SystemExit(f"{step['id']}: finished after {steps} steps, before its reload")
    return final


def run_engine(model: str, spec: dict, previous: dict | None = None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("connector") is not None:
        # short_name: the name alone, resolved by kvstore's vllm.general_plugins entry point
        path = {} if spec.get("short_name") else {"kv_connector_module_path": "kvstore.connectors.vllm"}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec["connector"], **path)
    if spec.get("probe"):
        kw["worker_extension_cls"] = "vllm_driver.KVStoreProbe"
    args = {"dtype": "float32", "block_size": 32, "max_model_len": 512, "max_num_seqs": 4,
            "enforce_eager": True, "seed": 0, "enable_prefix_caching": spec.get("prefix_caching", True),
            # scheduler and worker in the EngineCore process: they share one store
            "distributed_executor_backend": "uni", **kw}
    args.update(spec.get("llm") or {})
    llm = LLM(model=spec.get("model") or model, **args)
    results: dict = {}
    try:
        for step in spec["steps"]:
            if step["op"] == "corrupt":
                results.setdefault("corrupted", []).append(
                    corrupt_record(step["nvme_path"], step["record"]))
                continue
            if step["op"] == "corrupt_redis":
                results["corrupted"] = corrupt_redis_group(step["url"], step["group_size"])
                continue
            if step["op"] == "info":
                results[step["id"]] = json.loads(llm.collective_rpc("kvstore_info")[0])
                continue
            if step["op"] == "invalidate_groups":
                results[step["id"]] = json.loads(llm.collective_rpc(
                    "kvstore_invalidate", args=(step["kinds"], step.get("salt", "")))[0])
                continue
            if step["op"] == "tear_loads":
                results[step["id"]] = json.loads(llm.collective_rpc(
                    "kvstore_tear_loads", args=(step["kinds"], step.get("count", 1)))[0])
                continue
            if step["op"] == "torn":
                results[step["id"]] = json.loads(llm.collective_rpc("kvstore_torn")[0])
                continue
            if step["op"] == "wait":
                while not os.path.exists(step["file"]):
                    time.sleep(0.05)
                continue
            if step["op"] == "abort":
                engine = llm.llm_engine
                engine.add_request(step["id"], {"prompt_token_ids": step["tokens"]}, SamplingParams(
                    max_tokens=8, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": step["kv"]}))
                engine.step()                     # scheduled, prefilled, its blocks saved
                engine.abort_request([step["id"]])
                while engine.has_unfinished_requests():
                    engine.step()
                results[step["id"]] = {"aborted": True}
                continue
            prompt = _prompt(step)
            kv = _params(step, previous or {}, spec.get("params_from"))
            params = SamplingParams(max_tokens=step.get("max_tokens", 16), temperature=0.0,
                                    ignore_eos=True, logprobs=1 if step.get("logprobs") else None,
                                    extra_args={"kv_transfer_params": kv} if kv else None)
            if step["op"] == "reload_midway":
                out = _reload_midway(llm.llm_engine, step, prompt, params)
            else:
                out = llm.generate([prompt], params, use_tqdm=False, lora_request=_lora(step))[0]
            got = out.outputs[0]
            results[step["id"]] = {"tokens": list(got.token_ids), "cached": out.num_cached_tokens or 0,
                                   "kv": out.kv_transfer_params,
                                   "prompt_tokens": list(out.prompt_token_ids or [])}
            if step.get("logprobs"):
                results[step["id"]]["logprobs"] = [lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


def run_engines(spec: dict, out_path: str, before: Any = None) -> dict:
    """Run ``spec``'s engines in order, writing the results (atomically)
    after each, so partial results survive a later crash and a test can
    read an engine's as soon as it ends. An engine with ``"wait_for": FILE``
    starts only once that file exists (a test holds it while it restarts a
    daemon); ``before(engine)`` runs just before each engine starts."""
    out: dict = {"engines": {}}
    for engine in spec["engines"]:
        gate = engine.pop("wait_for", None)
        deadline = time.monotonic() + 300
        while gate and not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise SystemExit(f"gave up waiting for {gate}")
            time.sleep(0.1)
        if before is not None:
            before(engine)
        out["engines"][engine["name"]] = run_engine(spec["model"], engine, out["engines"])
        with open(out_path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(out_path + ".tmp", out_path)
    return out


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        run_engines(json.load(f), out_path)


if __name__ == "__main__":
    main()
