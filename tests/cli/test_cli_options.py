"""Bad numbers on the command line of `kvstore bench ...` and `kvstore demo`:
exit 2 with a message naming the option the user typed. The non-finite
checks walk the commands' options, so a new numeric option is covered
without a new test."""
import re

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


# -- every option explains itself; --version names the distribution -----------------------------
def every_command(cmd: click.Command = main, path: tuple[str, ...] = ("kvstore",)):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from every_command(sub, (*path, name))


def test_every_option_of_every_command_has_help_text():
    walked = list(every_command())
    assert {"serve", "keys", "check", "demo", "replay", "sweep", "tiers", "vllm"} <= {p[-1] for p, _ in walked}
    missing = [f"{' '.join(path)} {opt.opts[0]}" for path, cmd in walked for opt in cmd.params
               if isinstance(opt, click.Option) and opt.name not in ("help", "version")
               and not (opt.help or "").strip()]
    assert missing == []


def test_version_names_the_distribution():
    from kvstore.errors import DISTRIBUTION

    r = invoke("--version")
    assert r.exit_code == 0 and re.fullmatch(rf"kvstore \({DISTRIBUTION}\) \d+\.\d+\S*\n", r.output), r.output


# -- comma lists name their option when empty or wrong -------------------------------------------
@pytest.mark.parametrize("args,expected", [
    (["bench", "tiers", "--tiers", ""], "--tiers: give at least one of hbm, dram, nvme, redis"),
    (["bench", "tiers", "--tiers", " , "], "--tiers: give at least one of hbm, dram, nvme, redis"),
    (["bench", "tiers", "--tiers", "dram,ssd"], "--tiers: unknown ssd; choose from hbm, dram, nvme, redis"),
    (["bench", "replay", "--workload", "agent", "--policy", ""], "--policy: give at least one of hbm-only, "),
    (["bench", "replay", "--workload", "agent", "--policy", "lru,mru"], "--policy: unknown mru; choose from "),
])
def test_comma_lists_name_the_option_when_empty_or_unknown(args, expected):
    r = invoke(*args)
    assert r.exit_code == 2 and expected in r.output and "[]" not in r.output, r.output


def test_a_minimum_of_one_reads_in_the_singular():
    r = invoke("demo", "--working-set", "0")
    assert r.exit_code == 2 and "want at least 1 token, got '0'" in r.output
    r = invoke("bench", "tiers", "--block-size", "100")
    assert r.exit_code == 2 and "want at least 4096 bytes, got '100'" in r.output


# -- --nvme-path: the option, the path and the reason; no traceback ------------------------------
def test_bench_tiers_nvme_path_that_is_missing_or_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    small = ["bench", "tiers", "--tiers", "nvme", "--blocks", "1", "--repeats", "1", "--block-size", "4096"]
    for path, reason in ((tmp_path / "nonexistent" / "x", "cannot use it: no such directory"),
                         (afile, "cannot use it: not a directory")):
        r = invoke(*small, "--nvme-path", str(path))
        assert r.exit_code == 2, r.output
        assert r.output == f"error: --nvme-path {path}: {reason}\n"
    assert not (tmp_path / "nonexistent").exists()     # a bench never makes the device's folder


def test_demo_nvme_path_that_is_a_file_or_under_one(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for path, reason in ((afile, "cannot use it: not a directory"),
                         (afile / "sub", "cannot create it: Not a directory")):
        r = invoke("demo", "--max-requests", "5", "--nvme-path", str(path))
        assert r.exit_code == 2 and r.output == f"error: --nvme-path {path}: {reason}\n", r.output
