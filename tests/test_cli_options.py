"""Bad numbers on the command line of `kvstore bench ...` and `kvstore demo`:
exit 2 with a message naming the option the user typed. The non-finite
checks walk the commands' options, so a new numeric option is covered
without a new test."""
import click
import pytest
from click.testing import CliRunner

from kvstore.cli.common import FiniteFloat, Size, Thresholds, Tokens
from kvstore.cli.main import main
from kvstore.units import parse_count, parse_size

NUMERIC_TYPES = (click.types.FloatParamType, click.types.IntParamType, Size, Tokens, Thresholds)


def commands() -> list[tuple[list[str], click.Command]]:
    """(argv prefix, command) for every bench subcommand and demo."""
    bench = main.commands["bench"]
    assert isinstance(bench, click.Group)
    return [(["bench", name], cmd) for name, cmd in sorted(bench.commands.items())] + \
        [(["demo"], main.commands["demo"])]


def numeric_options() -> list[tuple[list[str], str, click.ParamType]]:
    out = [(prefix, opt.opts[0], opt.type) for prefix, cmd in commands() for opt in cmd.params
           if isinstance(opt, click.Option) and not opt.is_flag and isinstance(opt.type, NUMERIC_TYPES)]
    assert len(out) > 20      # the walk found the commands' options (not an empty parametrization)
    return out


def float_options() -> list[tuple[list[str], str, click.ParamType]]:
    return [o for o in numeric_options() if isinstance(o[2], click.types.FloatParamType)]


def cases(options: list[tuple[list[str], str, click.ParamType]]) -> list:
    return [pytest.param(*o, id=" ".join([*o[0], o[1]])) for o in options]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("prefix,flag,kind", cases(numeric_options()))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_naming_the_option(prefix, flag, kind, value):
    r = invoke(*prefix, flag, value)
    assert r.exit_code == 2, (prefix, flag, r.output)
    assert f"'{flag}'" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("prefix,flag,kind", cases(float_options()))
def test_every_float_option_is_a_finite_float(prefix, flag, kind):
    assert isinstance(kind, FiniteFloat), f"{' '.join(prefix)} {flag} reads nan/inf: use common.finite_float()"


@pytest.mark.parametrize("prefix,flag,kind", cases(numeric_options()))
def test_negative_numbers_are_refused_naming_the_option(prefix, flag, kind):
    r = invoke(*prefix, flag, "-5")
    assert r.exit_code == 2 and f"'{flag}'" in r.output, (prefix, flag, r.output)


def test_token_options_want_a_token_count_not_a_byte_size():
    for value in ("-5", "2MiB", "1.5"):
        r = invoke("bench", "replay", "--workload", "agent", "--dram-tokens", value)
        assert r.exit_code == 2
        assert f"Invalid value for '--dram-tokens': want a token count like 500K or 1.4M, got '{value}'" \
            in r.output
        assert "size" not in r.output.lower()


def test_demo_duration_names_the_option_and_the_value():
    r = invoke("demo", "--duration", "-5")
    assert r.exit_code == 2 and "Invalid value for '--duration'" in r.output and "-5" in r.output
    zero = invoke("demo", "--duration", "0")
    assert zero.exit_code == 2 and "'--duration'" in zero.output


def test_bench_tiers_blocks_names_blocks():
    r = invoke("bench", "tiers", "--blocks", "-3")
    assert r.exit_code == 2 and "Invalid value for '--blocks'" in r.output


def test_hbm_tokens_below_one_block_names_the_options():
    r = invoke("bench", "replay", "--workload", "agent", "--no-data-plane", "--hbm-tokens", "32")
    assert r.exit_code == 2 and "'--hbm-tokens'" in r.output and "--block-tokens 64" in r.output


def test_vllm_block_size_must_be_a_multiple_of_32():
    r = invoke("bench", "vllm", "--block-size", "48")
    assert r.exit_code == 2 and "'--block-size'" in r.output and "multiple of 32" in r.output


def test_thresholds_are_token_counts():
    r = invoke("bench", "replay", "--workload", "agent", "--thresholds", "100KiB,200K,300K")
    assert r.exit_code == 2 and "'--thresholds'" in r.output and "100K,250K,500K" in r.output


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999", "-5", "NaNK", "infM"])
def test_sizes_and_counts_refuse_non_numbers(text):
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_size(text)
    with pytest.raises(ConfigError):
        parse_count(text)


def test_counts_read_decimal_multipliers_only():
    assert [parse_count(t) for t in ("4096", "500K", "1.4M", "2g", "0")] == [4096, 500_000, 1_400_000, 2 * 10**9, 0]
