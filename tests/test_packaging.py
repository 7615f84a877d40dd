"""Every sub-package ships: pyproject lists packages by hand (the folders map
onto kvstore.* through package-dir), so a new package folder not listed there
would work in an editable install and be missing from a wheel."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = {"kvstore": "kvstore", **tool["package-dir"]}
    found = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "listed but not there"
