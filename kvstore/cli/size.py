"""``kvstore size``: a model and a token budget in, the bytes of each tier out
(and back: the tokens ``--dram`` / ``--nvme`` / ``--redis`` hold). The figures
come from :mod:`kvstore.sizing`; ready for ``main.add_command(size, "size")``."""
from __future__ import annotations

import json
import sys

import click

from kvstore.cli.common import Size, Tokens, fail
from kvstore.errors import ConfigError, KVStoreError
from kvstore.identity import DTYPE_BYTES

TOKEN_COUNT = Tokens(minimum=1)
TIER_SIZE = Size(minimum=4096)      # the smallest DRAM and NVMe tier kvstore serve takes


@click.command("size")
@click.option("--model", "model_name", default=None, metavar="NAME",
              help="A known model: llama3-8b, llama3-70b, qwen2.5-7b, qwen3-32b, mistral-7b, gemma3-12b, "
                   "gemma3-27b, gpt-oss-20b, gpt-oss-120b, deepseek-v3, demo (or a Hugging Face name such as "
                   "Llama-3.1-8B).")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False), metavar="PATH",
              help="A Hugging Face config.json to read the shape from, instead of --model.")
@click.option("--tokens", type=TOKEN_COUNT, default=None,
              help="A token budget (2M, 500K): the bytes each tier needs, and a suggested `kvstore serve` split.")
@click.option("--dram", type=TIER_SIZE, default=None, help="A DRAM size (8GiB): the tokens it holds.")
@click.option("--nvme", type=TIER_SIZE, default=None, help="An NVMe size (200GiB): the tokens it holds.")
@click.option("--redis", type=TIER_SIZE, default=None,
              help="A Redis tier's capacity_bytes (100GiB): the tokens it holds.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per block: the engine's block size [16, vLLM's default].")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default=None,
              help="The KV cache dtype, if not the model's (fp8_e4m3 for vLLM's --kv-cache-dtype fp8). A "
                   "config.json's float32 is sized as bfloat16, as vLLM's --dtype auto serves it; float32 "
                   "sizes it in fp32.")
@click.option("--hot", type=TOKEN_COUNT, default=None,
              help="With --tokens: the tokens the suggested split keeps in DRAM [a quarter of --tokens].")
@click.option("--context", type=TOKEN_COUNT, default=None,
              help="Hybrid (sliding-window) models: tokens per resume point, a prompt's end or branch [8K].")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--table", "as_table", is_flag=True,
              help="Print the Markdown table of every known model's KV bytes per token (docs/sizing.md's).")
def size(model_name: str | None, config_path: str | None, tokens: int | None, dram: int | None,
         nvme: int | None, redis: int | None, block_tokens: int | None, dtype: str | None, hot: int | None,
         context: int | None, as_json: bool, as_table: bool) -> None:
    """Turn a model and a token budget into bytes per tier, or tier sizes into tokens.

    \b
    kvstore size --model llama3-8b --tokens 2M
    kvstore size --model llama3-8b --dram 8GiB --nvme 200GiB
    kvstore size --config ./config.json --tokens 500K --json
    """
    from kvstore import sizing  # noqa: PLC0415 - imports the tiers' modules: on use

    capacities = {tier: value for tier, value in (("dram", dram), ("nvme", nvme), ("redis", redis))
                  if value is not None}
    if as_table:
        given = [flag for flag, value in (("--model", model_name), ("--config", config_path), ("--tokens", tokens),
                                          ("--hot", hot), ("--context", context), ("--dtype", dtype),
                                          ("--json", as_json or None), *((f"--{t}", v) for t, v in capacities.items()))
                 if value is not None]
        if given:
            raise click.UsageError(f"--table prints every known model; {given[0]} does not go with it")
        click.echo(sizing.table(block_tokens or sizing.DEFAULT_BLOCK_TOKENS), nl=False)
        return
    if (model_name is None) == (config_path is None):
        raise click.UsageError("give one of --model NAME or --config PATH (a Hugging Face config.json)")
    if tokens is not None and capacities:
        raise click.UsageError(f"--tokens and --{next(iter(capacities))}: give a token budget (to get bytes) "
                               "or tier sizes (to get tokens), not both")
    if hot is not None and tokens is None:
        raise click.UsageError("--hot needs --tokens (the DRAM share of a token budget)")
    if hot is not None and tokens is not None and not 0 < hot <= tokens:
        raise click.UsageError(f"--hot must be between 1 and --tokens ({tokens}), got {hot}")
    try:
        if config_path is not None:
            try:
                shape = sizing.shape_from_hf_config(config_path, dtype)
            except ConfigError as exc:
                raise ConfigError(f"--config {exc}") from None
        else:
            assert model_name is not None
            try:
                shape = sizing.model(model_name)
            except ConfigError as exc:
                raise ConfigError(f"--model: {exc}") from None
        if dtype is not None:
            shape = shape.with_dtype(dtype)
        rep = sizing.report(shape, block_tokens=block_tokens or sizing.DEFAULT_BLOCK_TOKENS, tokens=tokens,
                            capacities=capacities,
                            hot_tokens=hot,
                            context_tokens=context or sizing.DEFAULT_CONTEXT_TOKENS)
    except KVStoreError as exc:
        fail(exc)
    if as_json:
        json.dump(rep, sys.stdout, indent=2)
        click.echo()
    else:
        click.echo(sizing.render_text(rep), nl=False)
