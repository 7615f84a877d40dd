"""A hostile local user against a real ``kvstore serve`` start: the daemon
trusts nothing on disk it did not make (issue 25).

The attack that broke it: a user made the NVMe directory first, with a key
secret of their own and segments holding their bytes under the keys of a
public prompt; the daemon adopted both and served those bytes to a tenant
as hits. Now a state or NVMe directory (and every directory above it) must
be the daemon user's (or root's) and writable by no one else, or the start
fails naming the path, its owner and mode; what the daemon reads there is
opened without following a link or blocking on a FIFO, and only if it is a
regular file of its own. Settings that expose the daemon are said once in
a warning line; a guessable key secret is refused.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest

from kvstore.config_load import merge
from kvstore.daemon.tenants import SECRET_NAME
from kvstore.errors import TierUnavailable
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.tiers.segments import segment_name
from tests.redis_server import free_port
from tests.served import Served

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

IDENT = CacheIdentity("trust-model", KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                                              block_tokens=16, dtype="float16"))
BB = IDENT.layout.block_bytes
TOK_VICTIM, TOK_MALLORY = "victim-token-0001", "mallory-token-02"
NOBODY = 65534
PUBLIC_PROMPT = block_keys(IDENT, range(16 * 4))      # a system prompt every tenant sends


def needs_root() -> None:
    """Skip this test (not the module) unless it can make files another uid owns."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make files another user owns")


def config(root: Path, nvme: Path, token: str = TOK_VICTIM, **daemon) -> dict:
    """NVMe only (puts land in the segments), one tenant ``victim``."""
    cfg = {"store": {"nvme": {"path": str(nvme), "capacity_bytes": "64MiB", "segment_bytes": "4MiB"}},
           "daemon": {"listen": {"unix_path": str(root / "kv.sock")},
                      "tenants": [{"name": "victim", "token": token}]}}
    return merge(cfg, {"daemon": daemon})


def refused(d: Served) -> str:
    """Start ``d``, which must be refused; what it said. A start that succeeds
    is stopped and fails the test."""
    try:
        d.start()
    except TierUnavailable as exc:
        return str(exc)
    d.close()
    raise AssertionError(f"kvstore serve started:\n{d.log()[-2000:]}")


def chown_tree(top: Path, uid: int) -> None:
    for where, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(where, name), uid, uid)
    os.lchown(top, uid, uid)


# -- 1. a directory another user made ------------------------------------------------------
def test_an_nvme_directory_another_user_made_is_refused_not_served(tmp_path):
    """Mallory (uid 65534) makes the NVMe directory first and fills it: a key
    secret she knows, and segments holding her bytes under the victim's
    server keys for a public prompt (written here by a daemon run with the
    victim's tenant name and Mallory's token). Before: the daemon adopted
    both and the victim's read of the prompt returned her bytes as a hit."""
    needs_root()
    nvme = tmp_path / "nvme"
    poison = [np.full(BB, 0x66, np.uint8) for _ in PUBLIC_PROMPT]
    planter = Served(tmp_path / "mallory", TOK_MALLORY, config=config(tmp_path / "mallory", nvme, TOK_MALLORY))
    planter.start()
    try:
        with planter.client() as c:
            assert c.put(IDENT, PUBLIC_PROMPT, poison) == [PutOutcome.STORED] * len(PUBLIC_PROMPT)
    finally:
        planter.close()
    chown_tree(nvme, NOBODY)
    secret_before = (nvme / SECRET_NAME).read_bytes()

    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, nvme))
    try:
        d.start()
    except TierUnavailable as exc:
        said = str(exc)
    else:
        with d.client(TOK_VICTIM) as victim:
            got = victim.get(IDENT, PUBLIC_PROMPT[:1])[0]
        d.close()
        pytest.fail("the daemon adopted a directory another user made; the victim's read of a public "
                    f"prompt was served {'the attacker' if got is not None and got[0] == 0x66 else 'some'}'s bytes")
    assert f"store.nvme.path (--nvme-path) {nvme}: owned by uid {NOBODY}" in said, said
    assert "mode 0700" in said and "another user made it" in said, said
    assert "Traceback" not in said
    assert (nvme / SECRET_NAME).read_bytes() == secret_before    # nothing there was touched
    assert os.stat(nvme).st_uid == NOBODY


@pytest.mark.parametrize("where", ["nvme", "state_dir", "parent"])
def test_a_directory_others_can_write_or_swap_is_refused_naming_path_owner_and_mode(tmp_path, where):
    """A world-writable NVMe or state directory (anyone can plant a secret or
    segments in it), or one under a directory another user owns (who can
    rename it away and put their own in its place): the start fails and
    names the setting, the path at fault, its owner and its mode."""
    nvme, state = tmp_path / "nvme", tmp_path / "state"
    daemon: dict = {}
    if where == "nvme":
        nvme.mkdir(mode=0o700)
        nvme.chmod(0o777)
        at_fault, setting, why = nvme, "store.nvme.path (--nvme-path)", "owned by uid 0 (root), mode 0777"
    elif where == "state_dir":
        state.mkdir()
        state.chmod(0o777)
        daemon = {"state_dir": str(state)}
        at_fault, setting, why = state, "daemon.state_dir", "mode 0777: other users can write to it"
    else:
        needs_root()
        parent = tmp_path / "shared"
        parent.mkdir(mode=0o755)
        os.chown(parent, NOBODY, NOBODY)
        nvme = parent / "nvme"
        at_fault, setting, why = parent, "store.nvme.path (--nvme-path)", f"owned by uid {NOBODY}"
    said = refused(Served(tmp_path, TOK_VICTIM, config=config(tmp_path, nvme, **daemon)))
    assert setting in said and str(at_fault) in said and why in said, said
    assert "Traceback" not in said
    assert not (at_fault / SECRET_NAME).exists()


def test_directories_the_daemon_makes_are_private(tmp_path):
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, tmp_path / "nvme", state_dir=str(tmp_path / "st")))
    d.start()
    try:
        for made in (tmp_path / "nvme", tmp_path / "st"):
            assert os.stat(made).st_mode & 0o777 == 0o700, made
        assert os.stat(tmp_path / "st" / SECRET_NAME).st_mode & 0o777 == 0o600
    finally:
        d.close()


# -- 2. links and FIFOs where the daemon's files go ------------------------------------------
def test_a_planted_link_as_the_key_secret_is_not_followed(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"f" * 64 + b"\n")
    target.chmod(0o644)
    (nvme / SECRET_NAME).symlink_to(target)
    said = refused(Served(tmp_path, TOK_VICTIM, config=config(tmp_path, nvme)))
    assert f"{nvme / SECRET_NAME}: a symbolic link" in said, said
    assert target.read_bytes() == b"f" * 64 + b"\n" and target.stat().st_mode & 0o777 == 0o644   # not chmod-ed


def test_a_fifo_as_the_key_secret_does_not_hang_the_start(tmp_path):
    """Before: the open blocked until someone wrote to the FIFO; the start hung."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    os.mkfifo(nvme / SECRET_NAME, 0o600)
    said = refused(Served(tmp_path, TOK_VICTIM, config=config(tmp_path, nvme)))
    assert f"{nvme / SECRET_NAME}: not a regular file" in said, said


def test_a_planted_link_as_a_segment_is_not_followed_or_written(tmp_path):
    """A link named like a segment (the next id the daemon would take, and
    an older one): never opened through, never written through; the daemon
    serves on, in segments of its own."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    victim_file = tmp_path / "victim-file"
    victim_file.write_bytes(b"precious\n")
    for sid in (1, 2):
        (nvme / segment_name(sid)).symlink_to(victim_file)
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, nvme))
    d.start()
    try:
        data = [np.full(BB, 7, np.uint8) for _ in PUBLIC_PROMPT]
        with d.client() as c:
            assert c.put(IDENT, PUBLIC_PROMPT, data) == [PutOutcome.STORED] * len(PUBLIC_PROMPT)
            got = c.get(IDENT, PUBLIC_PROMPT)
            assert all(g is not None and np.array_equal(g, x) for g, x in zip(got, data))
    finally:
        d.close()
    assert victim_file.read_bytes() == b"precious\n"
    assert all((nvme / segment_name(sid)).is_symlink() for sid in (1, 2))
    assert any(p.is_file() and not p.is_symlink() for p in nvme.glob("*.seg"))


def test_a_segment_another_user_owns_is_not_adopted(tmp_path):
    """A segment file of another uid in the daemon's own directory (left from
    before the directory was made private): its records are not served."""
    needs_root()
    nvme = tmp_path / "nvme"
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, nvme))
    d.start()
    try:
        with d.client() as c:
            c.put(IDENT, PUBLIC_PROMPT, [np.full(BB, 0x66, np.uint8) for _ in PUBLIC_PROMPT])
    finally:
        d.close()
    segs = [p for p in nvme.glob("*.seg")]
    assert segs
    for p in segs:
        os.chown(p, NOBODY, NOBODY)
    d.start()
    try:
        with d.client() as c:
            assert c.lookup(PUBLIC_PROMPT).prefix_blocks == 0
    finally:
        d.close()
    assert "another user's file" in d.log()


# -- 3. settings: refused when clearly unsafe, said when exposing -----------------------------
@pytest.mark.parametrize("secret", ["aaaaaaaaaaaaaaaa", "abcdefghabcdefgh"])
def test_a_guessable_key_secret_is_refused_and_not_echoed(tmp_path, secret):
    said = refused(Served(tmp_path, TOK_VICTIM, config=config(tmp_path, tmp_path / "nvme", key_secret=secret)))
    assert "daemon.key_secret: too guessable" in said, said
    assert secret not in said


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("WARNING kvstore.daemon: daemon.")]


def test_exposure_settings_are_said_once_each_and_defaults_say_nothing(tmp_path):
    quiet = Served(tmp_path / "quiet", TOK_VICTIM,
                   config=config(tmp_path / "quiet", tmp_path / "quiet" / "nvme", metrics={"port": free_port()}))
    quiet.start()
    quiet.close()
    assert _warnings(quiet.log()) == []

    loud_root = tmp_path / "loud"
    cfg = config(loud_root, loud_root / "nvme", metrics={"host": "0.0.0.0", "port": free_port()},
                 listen={"unix_mode": "0777", "tcp_host": "0.0.0.0", "tcp_port": free_port()})
    loud = Served(loud_root, TOK_VICTIM, config=cfg)
    loud.start()
    try:
        assert os.stat(loud_root / "kv.sock").st_mode & 0o777 == 0o777
        with socket.create_connection(("127.0.0.1", cfg["daemon"]["listen"]["tcp_port"]), timeout=5):
            pass
    finally:
        loud.close()
    said = [w.removeprefix("WARNING kvstore.daemon: ") for w in _warnings(loud.log())]
    assert len(said) == 3, said
    for start in ("daemon.listen.unix_mode 0777: every local user", "daemon.listen.tcp_host 0.0.0.0: ",
                  "daemon.metrics.host 0.0.0.0: /metrics"):
        assert sum(w.startswith(start) for w in said) == 1, (start, said)
