"""One vLLM engine of ``kvstore bench vllm``, run inside vLLM's environment.

``python -m kvstore.bench.vllm_engine SPEC.json OUT.json``. The spec names
the model, the engine settings every row shares, the connector (none,
kvstore's or a peer's KVTransferConfig), a warm-up prompt and passes of
prompts. Each prompt is generated with ``max_tokens=1`` and greedy
sampling; its TTFT is the wall time of that ``generate`` call. Only JSON
crosses the process boundary.

Spec::

    {"model": DIR, "engine": {LLM kwargs}, "kv_transfer_config": {...} | null,
     "warmup": [token ids], "passes": [{"name": str, "prompts": [[token ids], ...]}]}

Output: ``{"startup_s": float, "passes": {name: [{"ttft_s", "token", "logprob",
"cached_tokens"}, ...]}}``.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any


def generate_one(llm: Any, tokens: list[int]) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
    ttft = time.perf_counter() - start
    first = out.outputs[0]
    token = int(first.token_ids[0])
    return {"ttft_s": ttft, "token": token, "logprob": float(first.logprobs[0][token].logprob),
            "cached_tokens": int(out.num_cached_tokens or 0)}


def run(spec: dict) -> dict:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = dict(spec["engine"])
    if spec.get("kv_transfer_config"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    start = time.perf_counter()
    llm = LLM(model=spec["model"], **kw)
    out: dict = {"startup_s": time.perf_counter() - start, "passes": {}}
    try:
        if spec.get("warmup"):
            out["warmup"] = generate_one(llm, spec["warmup"])   # first-call costs, not timed
        for p in spec["passes"]:
            out["passes"][p["name"]] = [generate_one(llm, toks) for toks in p["prompts"]]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
