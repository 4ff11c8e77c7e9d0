"""The docs name real files: every repository path README.md, PROTOCOL.md and docs/ARCHITECTURE.md
give exists, and a name a doc attaches to a file (`path.py` `Name`, `path.py: NAME`) is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "PROTOCOL.md", "docs/ARCHITECTURE.md")
SUFFIXES = (".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".lua")
# the repository's own top-level folders; a path under one is checked even without a suffix
TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".egg-info")}
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path in running text, outside backticks (not part of a URL or of a longer path)
PLAIN = re.compile(r"(?<![\w/.:~-])((?:[\w-]+/)+[\w-]+(?:\.py|\.md|\.sh|\.yml|\.yaml|\.toml))\b")
NAMED = re.compile(r"`([\w/]+\.py)(?::\s*([\w.]+))?`(?::?\s+`([\w.]+)`)?")


def repo_path(word: str) -> str | None:
    """``word`` as a path in the repository, or None when it is something else: a key
    (``{prefix}:queue:{name}``), a URL, an HTTP route, a flag, a home or cache folder, a
    command's arguments."""
    word = word.strip("()[],;:'\"").rstrip(".")
    if not word or re.search(r"[{}<>*$=|]|://", word) or word.startswith(("/", "~", "-", ".")):
        return None
    first = word.split("/")[0]
    if word.endswith(SUFFIXES) or ("/" in word and (word.endswith("/") or first in TOP)):
        return word
    return None


def named_paths(doc: str) -> list[str]:
    """Every repository path ``doc`` names in backticks, in its text or in a link."""
    text = (ROOT / doc).read_text()
    words = [w for code in CODE.findall(text) for w in re.split(r"[\s,]+", code)] + PLAIN.findall(text)
    paths = [p for p in map(repo_path, words) if p]
    links = [link.split("#")[0] for link in LINK.findall(text) if "://" not in link and not link.startswith("#")]
    return paths + [f"{Path(doc).parent}/{link}" for link in links if link]


def exists(path: str, doc: str) -> bool:
    """At the root, beside the doc, or (a bare file name, read in its context) somewhere in the tree."""
    if (ROOT / path).exists() or (ROOT / Path(doc).parent / path).exists():
        return True
    return "/" not in path and any(p for top in TOP for p in (ROOT / top).rglob(path))


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_path_a_doc_names_exists(doc):
    paths = named_paths(doc)
    assert len(paths) > 5, paths  # the extraction still finds the doc's paths
    assert sorted({p for p in paths if not exists(p, doc)}) == []


@pytest.mark.parametrize("doc", DOCS)
def test_a_name_a_doc_attaches_to_a_file_is_in_it(doc):
    missing = []
    for path, inline, following in NAMED.findall((ROOT / doc).read_text()):
        name = inline or following
        if name and (ROOT / path).is_file():
            source = (ROOT / path).read_text()
            if not all(re.search(rf"\b{re.escape(part)}\b", source) for part in name.split(".")):
                missing.append(f"{path}: {name}")
    assert missing == []


def test_the_check_tells_a_path_from_other_backticked_words():
    assert repo_path("engine/core/scheduler.py") == "engine/core/scheduler.py"
    assert repo_path("engine/runner/attention/") == "engine/runner/attention/"
    assert repo_path("aio.py") == "aio.py"
    for word in ("{prefix}:queue:{name}", "redis+sentinel://h1,h2,h3/service/0", "/v1/chat/completions",
                 "~/.cache/sluiceway/demo-tiny-llama", "--queue-shards", "submit/status/cancel/bulk/acl",
                 "h3/service/0", "OUT.jsonl.key", "pub/sub", ".cache/redis7"):
        assert repo_path(word) is None, word
    assert not exists("engine/core/no_such_file.py", "docs/ARCHITECTURE.md")
    assert exists("GATEWAY.md", "docs/ARCHITECTURE.md")
