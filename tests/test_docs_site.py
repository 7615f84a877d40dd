"""The docs site builds with MkDocs in strict mode (a broken link or a page left
out of the nav fails it), the README's links to docs/ reach real pages (as
GitHub resolves them), and every troubleshooting entry's message still occurs
in kvstore's source, so that section cannot describe errors that no longer
exist. CI installs MkDocs with the `test` extra: a missing MkDocs fails here."""
from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.readme_blocks import DOCS, README, ROOT, section

SOURCE = ROOT / "kvstore"
MKDOCS_TIMEOUT_S = 300


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=MKDOCS_TIMEOUT_S,
                          cwd=config.parent)


# --- the site ------------------------------------------------------------------------------------

def test_the_docs_site_builds_strict(tmp_path):
    r = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "sizing" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is what catches a link to a page that does not exist:
    a copy of the docs with one such link must fail it."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [a page that is gone](no-such-page.md).\n")
    r = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0
    assert "no-such-page.md" in r.stdout + r.stderr


def nav_pages(nav: list) -> set[str]:
    found = set()
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found |= nav_pages(value) if isinstance(value, list) else {value}
    return found


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    pages = {p.name for p in DOCS.glob("*.md")}
    assert nav_pages(config["nav"]) == pages


# --- the README's links ---------------------------------------------------------------------------

def test_the_readmes_links_to_docs_reach_pages():
    """Relative links, resolved from the README as GitHub does."""
    links = re.findall(r"\]\(((?!https?://|#)[^)\s]+)\)", README.read_text())
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README links to paths that do not exist: {missing}"


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    unlinked = [p.name for p in DOCS.glob("*.md") if p.name != "index.md" and f"(docs/{p.name})" not in text]
    assert not unlinked, f"docs pages the README's 'More' does not link: {unlinked}"


# --- troubleshooting -----------------------------------------------------------------------------

# an entry is a paragraph starting "**N. what happens: `MESSAGE`**"; "…" stands for a value
_ENTRY = re.compile(r"^\*\*(?P<n>\d+)\. (?P<head>.*?)\*\*", re.M | re.S)
_EDGES = " :;,.()\"'"


def troubleshooting_messages() -> dict[int, list[str]]:
    text = section("## Troubleshooting")
    return {int(m.group("n")): re.findall(r"`([^`]+)`", m.group("head")) for m in _ENTRY.finditer(text)}


def source_text() -> str:
    """kvstore's Python source, with adjacent string literals joined
    (``"of memory "`` / ``"available"`` reads as one message)."""
    text = "\n".join(p.read_text() for p in sorted(SOURCE.rglob("*.py")))
    return re.sub(r"\"\s*\n\s*f?\"", "", text)


def os_messages() -> set[str]:
    """Messages the OS supplies (``os.strerror``), which kvstore prints but does not contain."""
    return {os.strerror(code).lower() for code in errno.errorcode}


def message_pieces(message: str) -> list[str]:
    return [piece.strip(_EDGES) for piece in message.split("…") if piece.strip(_EDGES)]


def test_troubleshooting_has_the_ten_errors_each_with_its_message():
    entries = troubleshooting_messages()
    assert sorted(entries) == list(range(1, len(entries) + 1)) and len(entries) >= 10, sorted(entries)
    assert not [n for n, messages in entries.items() if not messages], "an entry quotes no message"


def test_every_troubleshooting_message_occurs_in_the_source():
    source, from_os = source_text(), os_messages()
    gone = {n: piece for n, messages in troubleshooting_messages().items() for message in messages
            for piece in message_pieces(message) if piece not in source and piece.lower() not in from_os}
    assert not gone, f"troubleshooting messages no longer in kvstore/ (entry: text): {gone}"


def test_a_message_not_in_the_source_is_caught():
    assert message_pieces("--dram …: is more than the … of memory available") == [
        "--dram", "is more than the", "of memory available"]
    source = source_text()
    assert all(piece in source for piece in message_pieces("--dram …: is more than the … of memory available"))
    assert "is less than the" not in source
