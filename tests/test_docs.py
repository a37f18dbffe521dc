"""The README and docs/: the README stays short, and every relative link between the pages
(README.md, docs/*.md, bench/results/history.md) reaches an existing file, and heading."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "history.md"]

#: Issue 36: the README fits on a few screens; everything else lives in docs/.
MAX_README_LINES = 250

#: Pages another branch of issue 36 writes (docs/django.md): linked from here already, checked
#: once they exist.
PENDING = {"docs/django.md"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks (a ``[x](y)`` in code is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept),
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(path: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z]+:", t)]


def test_slug_itself():
    assert slug("Where a task waits, and what waiting costs") == "where-a-task-waits-and-what-waiting-costs"
    assert slug("`task_prerun` and `task_postrun` around a lock wait") == "task_prerun-and-task_postrun-around-a-lock-wait"
    assert slug("Keys and znodes; sharing a lock with Java and kazoo services") == (
        "keys-and-znodes-sharing-a-lock-with-java-and-kazoo-services")


def test_readme_fits_on_a_few_screens():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move a subject to docs/"


def test_every_relative_link_resolves_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {rel})")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    orphans = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert orphans == [], "docs pages the README's Documentation table does not list"


def test_the_docs_spell_no_limit_one_way():
    import re

    from celery_zklock.config import SETTINGS

    readme = README.read_text()
    for name in ("lock_timeout", "zklock_timeout"):
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
        assert "`math.inf` = no limit" in row and not re.search(r"None`? = no limit", row), row
    assert "math.inf = no limit" in SETTINGS["zklock_timeout"].help
