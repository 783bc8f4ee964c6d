"""The README and docs/ as one set of pages: every relative link names a file of the repository (and,
with a #fragment into a Markdown file, one of its headings, as GitHub spells the anchor), none points
into shared/ (development only), docs/README.md lists every page of docs/, and the README stays a
ten-minute read. Each check is a function of the texts, also run on a broken copy."""

from __future__ import annotations

import re
from pathlib import Path

from deploy_files import REPO

README_MAX_LINES = 300  # issue 42: the README is what a newcomer reads in ten minutes; detail lives in docs/


def pages() -> dict[Path, str]:
    return {path: path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_errors(texts: dict[Path, str]) -> list[str]:
    errors = []
    for page, text in texts.items():
        prose = re.sub(r"```.*?```", "", text, flags=re.S)  # links only count outside code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            where = f"{page.relative_to(REPO)}: link {target}"
            if "shared/" in target:
                errors.append(f"{where} points into shared/, which only development has")
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                errors.append(f"{where} is not a file of the repository")
            elif fragment and dest.suffix == ".md":
                body = texts.get(dest, dest.read_text())
                headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", body, flags=re.S),
                                                         re.M)}
                if fragment not in headings:
                    errors.append(f"{where}: {dest.name} has no heading #{fragment}")
    return errors


def toc_errors(texts: dict[Path, str]) -> list[str]:
    toc = texts[REPO / "docs" / "README.md"]
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", toc))
    return [f"docs/README.md does not list docs/{page.name}" for page in texts
            if page.parent.name == "docs" and page.name != "README.md" and page.name not in listed]


def test_every_link_of_the_readme_and_docs_resolves() -> None:
    assert link_errors(pages()) == []


def test_docs_readme_lists_every_page() -> None:
    assert toc_errors(pages()) == []


def test_the_readme_stays_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_broken_links_fail() -> None:
    texts = pages()
    readme = REPO / "README.md"
    for broken, says in [("[x](docs/nowhere.md)", "is not a file"), ("[x](docs/training.md#no-such-heading)", "no heading"),
                         ("[x](../shared/DESIGN.md)", "shared/")]:
        errors = link_errors({**texts, readme: texts[readme] + f"\nSee {broken}.\n"})
        assert len(errors) == 1 and says in errors[0], (broken, errors)
    toc = REPO / "docs" / "README.md"
    assert toc_errors({**texts, toc: texts[toc].replace("(training.md)", "(elsewhere)")}) == [
        "docs/README.md does not list docs/training.md"]
