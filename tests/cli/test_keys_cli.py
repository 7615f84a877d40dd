"""`kvstore keys`: what its files may say, and what it says back (issue 17).

Through click's runner on the real command with real files: every bad
file exits 2 with one `error: ...` line naming the field, never Python's own
error text; valid files print exactly the keys `block_keys` makes.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstore.cli.main import main
from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity
from kvstore.keys import KeyChain, MediaRef, block_keys

ID = {"model_id": "m/x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16, "dtype": "float16"}
TOKENS = list(range(100, 150))        # 3 sealed blocks of 16 and a partial tail of 2
LEAKS = ("Traceback", "KeyError", "TypeError", "object has no attribute", "indices must be",
         "unhashable", "not subscriptable", "invalid literal")


def run(tmp_path, identity: object, tokens: object, *extra_args: str):
    ident, toks = tmp_path / "id.json", tmp_path / "tokens.json"
    ident.write_text(identity if isinstance(identity, str) else json.dumps(identity))
    toks.write_text(tokens if isinstance(tokens, str) else json.dumps(tokens))
    return CliRunner().invoke(main, ["keys", "--identity", str(ident), "--tokens", str(toks), *extra_args])


def assert_error(result, *needles: str) -> None:
    out = result.output
    assert result.exit_code == 2, out
    assert out.startswith("error: ") and out.count("\n") == 1, out
    for needle in needles:
        assert needle in out, (needle, out)
    for leak in LEAKS:
        assert leak not in out, (leak, out)


def printed(result) -> list[str]:
    assert result.exit_code == 0, result.output
    return result.output.split()


# -- valid files key as before -------------------------------------------------------
def test_valid_files_print_the_keys_block_keys_makes(tmp_path):
    identity = CacheIdentity.from_dict(ID)
    assert printed(run(tmp_path, ID, TOKENS)) == [k.hex() for k in block_keys(identity, TOKENS)]
    extras = [[], [{"hash": "sha256:img", "tokens": 12}, {"hash": "sha256:aud", "tokens": 4}],
              [{"hash": "sha256:img", "tokens": 16}]]
    refs = [[MediaRef(m["hash"], m["tokens"]) for m in block] for block in extras]
    got = printed(run(tmp_path, ID, {"tokens": TOKENS, "extras": extras}))
    assert got == [k.hex() for k in block_keys(identity, TOKENS, refs)]
    assert got[0] == block_keys(identity, TOKENS)[0].hex() and got[1] != block_keys(identity, TOKENS)[1].hex()


def test_equal_duplicates_are_accepted_and_key_as_one(tmp_path):
    once = printed(run(tmp_path, ID, TOKENS))
    twice = {**ID, "block_tokens": 16, "layout": {"num_layers": 2, "block_size": 16}}
    assert printed(run(tmp_path, twice, TOKENS)) == once
    nested = {k: v for k, v in ID.items() if k in ("model_id",)}
    nested["layout"] = {k: v for k, v in ID.items() if k != "model_id"}
    assert printed(run(tmp_path, nested, TOKENS)) == once


def test_fewer_extras_than_blocks_means_no_media_in_the_rest(tmp_path):
    plain = printed(run(tmp_path, ID, TOKENS))
    assert printed(run(tmp_path, ID, {"tokens": TOKENS, "extras": []})) == plain
    one = printed(run(tmp_path, ID, {"tokens": TOKENS, "extras": [[{"hash": "h", "tokens": 16}]]}))
    assert one[0] != plain[0] and len(one) == 3


def test_string_extra_values_key_as_before():
    """The canonical form of string-valued ``extra`` is unchanged: the same
    namespace as an identity built with the pairs directly."""
    built = CacheIdentity.from_dict({**ID, "extra": {"b": "2", "a": "1"}})
    direct = CacheIdentity.from_dict(ID).replace(extra=(("a", "1"), ("b", "2")))
    assert built == direct and built.namespace == direct.namespace


# -- conflicting values ------------------------------------------------------------------
@pytest.mark.parametrize("identity, needles", [
    ({**ID, "block_tokens": 32}, ["block_size is 16", "block_tokens is 32"]),
    ({**ID, "layout": {"num_layers": 4}}, ["layout.num_layers is 4", "num_layers is 2"]),
    ({**ID, "layout": {"block_tokens": 8}}, ["layout.block_tokens is 8", "block_size is 16"]),
    ({**ID, "layout": {"dtype": "bfloat16"}}, ['layout.dtype is "bfloat16"', 'dtype is "float16"']),
    ({**ID, "num_layers": 2.0, "layout": {"num_layers": 2}}, ["layout.num_layers is 2", "num_layers is 2.0"]),
])
def test_conflicting_values_are_errors_naming_both(tmp_path, identity, needles):
    assert_error(run(tmp_path, identity, TOKENS), "conflicting values", *needles)


# -- bad identity fields -------------------------------------------------------------------
@pytest.mark.parametrize("change, needles", [
    ({"num_layers": "32"}, ["num_layers", '"32"']),
    ({"num_layers": True}, ["num_layers", "true"]),
    ({"num_layers": 0}, ["num_layers"]),
    ({"rope_theta": "x"}, ["rope_theta", '"x"']),
    ({"rope_theta": True}, ["rope_theta"]),
    ({"tp_size": 2, "tp_rank": "1"}, ["tp_rank"]),
    ({"dtype": [1]}, ["dtype"]),
    ({"attention": {"a": 1}}, ["attention"]),
    ({"model_id": 5}, ["model_id"]),
    ({"layout": None}, ["layout must be an object"]),
    ({"layout": [1]}, ["layout must be an object"]),
    ({"layout": {"colour": 1}}, ["unknown layout field", "colour"]),
    ({"extra": {"a": 1}}, ["extra.a must be a string", "got 1"]),
    ({"extra": {"a": None}}, ["extra.a must be a string", "null"]),
    ({"extra": ["a"]}, ["extra must be an object of string values"]),
])
def test_bad_identity_fields_are_errors_naming_the_field(tmp_path, change, needles):
    assert_error(run(tmp_path, {**ID, **change}, TOKENS), "identity ", *needles)


def test_extra_values_must_be_strings_so_1_and_quoted_1_never_share_keys(tmp_path):
    with pytest.raises(ConfigError, match="extra.a must be a string"):
        CacheIdentity.from_dict({**ID, "extra": {"a": 1}})
    quoted = printed(run(tmp_path, {**ID, "extra": {"a": "1"}}, TOKENS))
    assert quoted != printed(run(tmp_path, ID, TOKENS))
    assert_error(run(tmp_path, {**ID, "extra": {"a": 1}}, TOKENS), "extra.a")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_block_size_option_names_the_option(tmp_path, value):
    assert_error(run(tmp_path, ID, TOKENS, "--block-size", value), "--block-size", value)


# -- extras ------------------------------------------------------------------------------
@pytest.mark.parametrize("extras, needles", [
    ([[], [], [], []], ["extras has 4 entries", "3 sealed block(s) of 16"]),
    ([[], [], [], [], [], []], ["extras has 6 entries"]),
])
def test_extras_for_blocks_that_do_not_exist_are_errors(tmp_path, extras, needles):
    assert_error(run(tmp_path, ID, {"tokens": TOKENS, "extras": extras}), *needles)


@pytest.mark.parametrize("item, needles", [
    ({"hash": "x"}, ['extras[1][0]: missing "tokens"', '"tokens": <1..16']),
    ({"tokens": 3}, ['extras[1][0]: missing "hash"']),
    ("abc", ["extras[1][0]: a media item is", 'got "abc"']),
    (5, ["extras[1][0]: a media item is", "got 5"]),
    (["x", 3], ["extras[1][0]: a media item is"]),
    ({"hash": "x", "tokens": 3, "offset": 2}, ['unknown field(s) "offset"']),
    ({"hash": 7, "tokens": 3}, ["extras[1][0].hash must be a non-empty string", "got 7"]),
    ({"hash": "", "tokens": 3}, ["extras[1][0].hash must be a non-empty string"]),
    ({"hash": "x", "tokens": "3"}, ["extras[1][0].tokens must be an int in 1..16", 'got "3"']),
    ({"hash": "x", "tokens": True}, ["extras[1][0].tokens", "got true"]),
    ({"hash": "x", "tokens": 3.0}, ["extras[1][0].tokens", "got 3.0"]),
    ({"hash": "x", "tokens": 0}, ["extras[1][0].tokens must be an int in 1..16", "got 0"]),
    ({"hash": "x", "tokens": 17}, ["extras[1][0].tokens must be an int in 1..16", "got 17"]),
    ({"hash": "x", "tokens": 576}, ["extras[1][0].tokens", "got 576"]),
    ({"hash": "x", "tokens": -1}, ["extras[1][0].tokens", "got -1"]),
])
def test_a_malformed_media_item_is_a_clear_error(tmp_path, item, needles):
    extras = [[], [item]]
    assert_error(run(tmp_path, ID, {"tokens": TOKENS, "extras": extras}), "tokens file ", *needles)


def test_a_long_bad_value_is_echoed_cut_short(tmp_path):
    result = run(tmp_path, ID, {"tokens": TOKENS, "extras": [["y" * 5000]]})
    assert_error(result, "extras[0][0]", "...")
    assert len(result.output) < 400


@pytest.mark.parametrize("tokens, needles", [
    ({"tokens": TOKENS, "extras": "x"}, ["extras must be a list"]),
    ({"tokens": TOKENS, "extras": [5]}, ["extras[0] must be a list of media items"]),
    ({"tokens": TOKENS, "extras": None}, ["extras must be a list"]),
    ({"tokens": [1, "a"]}, ["tokens[1] is \"a\""]),
    ({"tokens": [1, True]}, ["tokens[1] is true"]),
    ('{"tokens": [1, NaN]}', ["tokens[1] is NaN"]),
    ('[1, 1e999]', ["tokens[1] is Infinity"]),
    ({"tokens": [2 ** 32]}, ["token ids must be in [0, 2**32)"]),
    ({"tokens": "abc"}, ["tokens must be a JSON list of ints"]),
    ({"tokenz": [1]}, ['needs "tokens"', '"tokenz"']),
])
def test_bad_tokens_files_are_clear_errors(tmp_path, tokens, needles):
    assert_error(run(tmp_path, ID, tokens), *needles)


# -- the library checks the media count too ---------------------------------------------------
def test_the_key_chain_refuses_a_media_count_larger_than_its_block_and_extends_nothing():
    identity = CacheIdentity.from_dict(ID)
    chain = KeyChain(identity)
    with pytest.raises(ConfigError, match=r"extras\[1\]\[0\]: num_tokens 17"):
        chain.extend(TOKENS, [[], [MediaRef("h", 17)]])
    assert chain.keys == [] and chain.pending_tokens == 0
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match="num_tokens"):
            MediaRef("h", bad)
    with pytest.raises(ConfigError, match="extras has 4 entries"):
        block_keys(identity, TOKENS, [[], [], [], []])


def test_one_blocks_media_fill_at_most_its_positions_in_all(tmp_path):
    """Two media never share a position: 10 + 10 positions of a 16-token block is a mistake,
    in the file and in the library; 12 + 4 (the valid test above) fills it exactly."""
    two = [[{"hash": "a", "tokens": 10}, {"hash": "b", "tokens": 10}]]
    assert_error(run(tmp_path, ID, {"tokens": TOKENS, "extras": two}),
                 "tokens file", "extras[0]", "fill 20 token positions", "block's 16")
    chain = KeyChain(CacheIdentity.from_dict(ID))
    with pytest.raises(ConfigError, match=r"extras\[1\]: its media fill 17"):
        chain.extend(TOKENS, [[], [MediaRef("a", 16), MediaRef("b", 1)]])
    assert chain.keys == [] and chain.pending_tokens == 0


# -- a key given twice is not a last-wins guess ---------------------------------------------
@pytest.mark.parametrize("identity, tokens, needles", [
    ('{"model_id": "m/x", "num_layers": 32, "num_kv_heads": 2, "head_dim": 32, "block_size": 16, '
     '"num_layers": 16}', TOKENS, ["id.json", '"num_layers" appears twice']),
    (ID, '{"tokens": [1, 2], "tokens": [3]}', ["tokens.json", '"tokens" appears twice']),
    (ID, '{"tokens": [1], "extras": [[{"hash": "a", "tokens": 1, "hash": "b"}]]}',
     ["tokens.json", '"hash" appears twice']),
])
def test_a_key_given_twice_is_an_error_naming_the_key_and_the_file(tmp_path, identity, tokens, needles):
    assert_error(run(tmp_path, identity, tokens), *needles)


def test_a_file_that_is_not_json_is_named_once(tmp_path):
    result = run(tmp_path, "{not json", TOKENS)
    assert_error(result, "not valid JSON")
    assert result.output.count("id.json") == 1 and result.output.startswith(f"error: identity {tmp_path}")


@pytest.mark.parametrize("command", ["keys", "check", "serve"])
def test_every_option_says_what_it_is_for(command):
    options = [p for p in main.commands[command].params if p.param_type_name == "option"]
    assert options and [p.name for p in options if not (p.help or "").strip()] == []
