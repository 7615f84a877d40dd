"""The strict test mode (KVSTORE_TEST_STRICT=1, what CI runs) turns every skip
into a failure, a module skipped at collection included (GPU tests apart)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path: Path, body: str, strict: bool) -> subprocess.CompletedProcess:
    """pytest on one module under this project's conftest (copied beside it)."""
    (tmp_path / "tests").mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    conftest = (ROOT / "tests" / "conftest.py").read_text().replace(
        'pytest_plugins = ["tests.redis_server"]', "pytest_plugins = []")
    (tmp_path / "tests" / "conftest.py").write_text(conftest)
    (tmp_path / "tests" / "test_mod.py").write_text(body)
    env = {**os.environ, "KVSTORE_TEST_STRICT": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_module_skipped_at_collection_fails_in_strict_mode(tmp_path):
    body = 'import pytest\npytest.importorskip("no_such_module_kvstore")\n\ndef test_a():\n    pass\n'
    strict = run_pytest(tmp_path / "s", body, strict=True)
    assert strict.returncode != 0 and "skipped at collection" in strict.stdout, strict.stdout
    loose = run_pytest(tmp_path / "l", body, strict=False)
    assert loose.returncode in (0, 5) and "1 skipped" in loose.stdout, loose.stdout   # 5: no test ran


def test_a_skipped_test_fails_in_strict_mode_but_a_gpu_one_does_not(tmp_path):
    body = ('import pytest\n\ndef test_skips():\n    pytest.skip("no redis")\n\n'
            '@pytest.mark.gpu\ndef test_gpu():\n    pytest.skip("no GPU")\n')
    r = run_pytest(tmp_path, body, strict=True)
    assert "1 failed" in r.stdout and "1 skipped" in r.stdout, r.stdout
