"""kvstore/private_paths.py on its own: what it makes is what it then trusts."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

_MAKE_UNDER_UMASK = """
import os, sys
os.umask(int(sys.argv[2], 8))
from kvstore.private_paths import check_private_dir, make_private_dir
make_private_dir(sys.argv[1])
assert check_private_dir(sys.argv[1])
"""


def test_the_directories_it_makes_are_private_under_a_group_writable_umask(tmp_path: Path):
    """Under umask 002 (per-user groups: Debian, Ubuntu), ``os.makedirs`` made
    the missing parents 0775, and the check that followed refused them: a
    first ``kvstore serve --nvme-path ./cache/nvme`` failed. Every part it
    makes is 0700 now. (In a child: the umask is the whole process's.)"""
    tmp_path.chmod(0o700)
    target = tmp_path / "cache" / "deeper" / "nvme"
    subprocess.run([sys.executable, "-c", _MAKE_UNDER_UMASK, str(target), "002"], check=True,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    for made in (tmp_path / "cache", tmp_path / "cache" / "deeper", target):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
