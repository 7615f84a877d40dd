"""The fenced blocks of README.md and of every docs/*.md page, each with the
test marker on the line before it.

A marker is an HTML comment (invisible on the rendered page):

    <!-- test: KIND[ ARG][, FLAG[ ARG]]...[ (NOTE)][; sub: FROM => TO[; FROM => TO]...] -->

KIND says what tests/test_readme.py does with the block:

    run               execute it (```python with python, anything else with bash) in a temp dir
    serve             start it, wait until it listens, SIGTERM it: it must exit 0
    setup             the set-up block (its own test: the demo runs, .ci/run execs the test command)
    file NAME         a file's contents (its own test feeds it to the command that reads it)
    connector-config  an engine's launch line: the kvstore part of its JSON config is parsed
    text              not a command (a tree, a diagram, a format, the synopsis); NOTE says which
    run-by TEST       a command that TEST (a test file) runs itself, with the substitutions:
                      it is slow or needs what that test sets up (real vLLM engines)

FLAGs of ``run``: ``continues`` (appended to the python block before it, at the
indentation of that block's last line: inside its ``with``), ``given NAME`` (a
preamble defining what the block takes as given), ``redis`` / ``trace`` /
``vllm-venv`` (needs a redis-server / the shared traces / LMCache's venv).
``sub`` replaces literal text before the block runs; ``{name}`` in a
replacement is filled in by the test (a free port, the shared folder).

A fenced block without a marker is an error, so a new block cannot go
untested by accident.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
KINDS = ("run", "run-by", "serve", "setup", "file", "connector-config", "text")
_MARKER = re.compile(r"^<!-- test: (?P<body>.*?)\s*-->$")
_FENCE = re.compile(r"^```(?P<info>\S*)\s*$")
_NOTE = re.compile(r"\((?P<note>[^()]*(?:\([^()]*\)[^()]*)*)\)\s*$")


def pages() -> list[Path]:
    """Every page whose blocks are checked: the README, then docs/*.md by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def page(name: str) -> Path:
    """A docs page by file name (``cli.md``)."""
    return DOCS / name


@dataclass(frozen=True)
class Block:
    line: int                                   # 1-based line of the opening fence
    info: str                                   # the fence's info string: bash, python, json or ""
    text: str
    kind: str | None = None                     # None: no marker before the fence
    arg: str = ""                               # file NAME, connector-config ENGINE
    flags: dict[str, str] = field(default_factory=dict)
    note: str = ""
    subs: tuple[tuple[str, str], ...] = ()
    path: Path = README                         # the page it is on

    @property
    def where(self) -> str:
        """``README.md:L12`` / ``docs/cli.md:L12``: the page and line, for messages."""
        rel = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{rel}:L{self.line}"

    @property
    def name(self) -> str:
        first = self.text.strip().splitlines()[0] if self.text.strip() else ""
        return f"{self.where}:{first[:40]}"

    def substituted(self, values: dict[str, str]) -> str:
        """The block's text with each ``sub`` applied; every FROM must occur,
        so a README edit cannot silently turn a substitution into a no-op."""
        text = self.text
        for old, new in self.subs:
            if old not in text:
                raise AssertionError(f"{self.where}: substitution {old!r} not in the block")
            text = text.replace(old, new.format(**values))
        return text


def parse_marker(body: str) -> tuple[str, str, dict[str, str], str, tuple[tuple[str, str], ...]]:
    """(kind, arg, flags, note, subs) of a marker's body."""
    head, _, sub_part = body.partition("; sub:")
    subs = []
    for item in filter(None, (s.strip() for s in sub_part.split(";"))):
        old, sep, new = item.partition(" => ")
        if not sep:
            raise ValueError(f"substitution {item!r} has no ' => '")
        subs.append((old.strip(), new.strip()))
    note = ""
    m = _NOTE.search(head)
    if m:
        note, head = m.group("note"), head[:m.start()]
    first, *rest = [part.strip() for part in head.split(",")]
    kind, _, arg = first.partition(" ")
    flags = {}
    for part in rest:
        flag, _, value = part.partition(" ")
        flags[flag] = value
    return kind, arg.strip(), flags, note, tuple(subs)


def blocks(path: Path = README) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.name} line {i + 1}: fence never closed")
        text = "\n".join(lines[i + 1:end]) + "\n"
        marker = _MARKER.match(lines[i - 1]) if i else None
        if marker:
            kind, arg, flags, note, subs = parse_marker(marker.group("body"))
            found.append(Block(i + 1, fence.group("info"), text, kind, arg, flags, note, subs, path))
        else:
            found.append(Block(i + 1, fence.group("info"), text, path=path))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    """The blocks of every page (:func:`pages`), in page order."""
    return [b for p in pages() for b in blocks(p)]


def section(heading: str, path: Path = README) -> str:
    """The text under a ``## heading`` up to the next heading of that level or higher."""
    text = "\n" + path.read_text()            # a page's title is its first line
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ")[0]
    nxt = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start + len(heading) + 2)
    return text[start:nxt.start() if nxt else len(text)]


def table_rows(text: str) -> dict[str, str]:
    """First cell -> the rest of the row, for every Markdown table row in ``text``
    (``\\|`` inside a cell is a literal bar)."""
    rows = {}
    for line in text.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells:
            rows[cells[0]] = " | ".join(cells[1:])
    return rows
