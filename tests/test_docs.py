"""The documentation: README.md (short, its relative links and anchors resolve) and the mkdocs
site under docs/ (``mkdocs build --strict`` passes offline: mkdocs.yml's ``validation`` makes a
broken link or anchor, or a page left out of the nav, fail it), and the copy of the step-input
tables in docs/design.md equals what the records print."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def outside_code(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def heading_text(raw: str) -> str:
    """A heading as rendered text: links reduced to their text, code and emphasis marks dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[`*]", "", text)


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """The anchor mkdocs gives the same heading (Python-Markdown's toc extension)."""
    from markdown.extensions.toc import slugify

    return slugify(text, "-")


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """The heading anchors of a markdown file, as GitHub and as mkdocs name them."""
    texts = [heading_text(m.group(2)) for line in outside_code(path.read_text()) if (m := HEADING.match(line))]
    return {github_slug(t) for t in texts}, {mkdocs_slug(t) for t in texts}


def relative_links(path: Path) -> list[str]:
    """The link targets of a markdown file that point into the repository (no scheme)."""
    found = [m.group(1) for line in outside_code(path.read_text()) for m in LINK.finditer(line)]
    return [t for t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file is missing, or whose anchor no heading of that
    file has, in GitHub's rendering or in the mkdocs site's."""
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor:
            if dest.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not markdown")
                continue
            github, mkdocs = anchors(dest)
            if anchor not in github or anchor not in mkdocs:
                broken.append(f"{target}: no heading with anchor #{anchor} (GitHub: {sorted(github)})")
    return broken


DOC_FILES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
PATH = re.compile(r"(?<![\w/.<-])(?:(neuronfx|scripts|tests|docs)/[\w./-]*[\w/]|(config|graphs|runtime|io|server)/[\w/-]+\.(?:py|cpp))")
DOTTED = re.compile(r"(?<![\w./])neuronfx(?:\.[A-Za-z_]\w*)+")
LOGGERS = {"neuronfx.cache", "neuronfx.compile", "neuronfx.server"}  # logger names, not modules


def named_paths(text: str) -> set[str]:
    """Repository paths a page names: ``neuronfx/...``, ``scripts/...``, ``tests/...``, ``docs/...``,
    and ``config/x.py``-style paths inside the package (read as ``neuronfx/config/x.py``)."""
    return {m.group(0) if m.group(1) else f"neuronfx/{m.group(0)}" for m in PATH.finditer(text) if "<" not in m.group(0)}


def resolves(dotted: str) -> bool:
    """Whether ``neuronfx.a.b.name`` names a package or module of the source tree, or a name that
    module defines or imports (read statically: nothing is imported)."""
    if dotted in LOGGERS:
        return True
    path, parts = ROOT, dotted.split(".")
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
        else:
            module = path / "__init__.py" if path.is_dir() else path
            return i < len(parts) and module.is_file() and re.search(rf"\b{re.escape(part)}\b", module.read_text()) is not None
        if path.suffix == ".py" and i + 1 < len(parts):
            return re.search(rf"\b{re.escape(parts[i + 1])}\b", path.read_text()) is not None
    return True


def test_docs_name_files_and_modules_that_exist():
    """Every source path and ``neuronfx.*`` name the README and the docs give exists, so a module
    that moves shows here until its pages follow it."""
    missing = []
    for doc in DOC_FILES:
        text = doc.read_text()
        missing += [f"{doc.relative_to(ROOT)}: {p}" for p in sorted(named_paths(text)) if not (ROOT / p).exists()]
        missing += [f"{doc.relative_to(ROOT)}: {d}" for d in sorted(set(DOTTED.findall(text))) if not resolves(d)]
    assert missing == []


def test_name_checker_finds_missing_names():
    text = ("`scripts/soak.py` `graphs/phases/decode.py` `neuronfx/graphs/models/<model_type>.py` `neuronfx.config.inputs.describe` "
            "`neuronfx.compile` `scripts/bench_nothing.py` `runtime/nothing.py` `neuronfx.config.nothing` "
            "`neuronfx.graphs.models.ops.NoSuchName` see /docs.")
    assert sorted(p for p in named_paths(text) if not (ROOT / p).exists()) == ["neuronfx/runtime/nothing.py", "scripts/bench_nothing.py"]
    assert [d for d in DOTTED.findall(text) if not resolves(d)] == ["neuronfx.config.nothing", "neuronfx.graphs.models.ops.NoSuchName"]


def test_readme_fits_on_a_few_screens():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_readme_links_resolve():
    assert len(relative_links(README)) >= 10, "the README points into docs/"
    assert broken_links(README) == []


def test_readme_links_every_docs_section():
    """Every top-level page of the site is reachable from the README."""
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()


def test_link_checker_finds_broken_links(tmp_path):
    """The checker itself: a missing file and a missing anchor are reported, good links are not."""
    (tmp_path / "page.md").write_text("# Page\n\n## The server's bad requests\n\n```\n# not a heading\n```\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](page.md) [ok](page.md#the-servers-bad-requests) [ok](#doc) [web](https://example.com/x.md)\n"
        "[gone](nope.md) [bad](page.md#not-a-heading) [bad](page.md#nothing)\n\n```\n[in code](ignored.md)\n```\n"
    )
    assert [b.split(":")[0] for b in broken_links(doc)] == ["nope.md", "page.md#not-a-heading", "page.md#nothing"]


def test_slugs_match_github_and_mkdocs():
    for heading, slug in [("Serving over HTTP: `neuronfx serve`", "serving-over-http-neuronfx-serve"),
                          ("The server's bad requests", "the-servers-bad-requests"),
                          ("neuronfx bench-serving", "neuronfx-bench-serving"),
                          ("When it pays, and limits", "when-it-pays-and-limits")]:
        assert github_slug(heading_text(heading)) == slug
        assert mkdocs_slug(heading_text(heading)) == slug


def test_site_builds_strict_offline(tmp_path, monkeypatch, caplog):
    """``mkdocs build --strict`` into a temporary directory, with the network unreachable: a
    broken link or anchor, a page missing from the nav, or a plugin that fetches fails it."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # mkdocs-material's banner about its successor

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"mkdocs build tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    site = tmp_path / "site"
    config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(site))
    caplog.set_level(logging.WARNING, logger="mkdocs")
    config.plugins.on_startup(command="build", dirty=False)  # as `mkdocs build` does
    try:
        build(config)
    except Abort as e:
        pytest.fail(f"{e}\n" + "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING))
    finally:
        config.plugins.on_shutdown()
    for page in ("index.html", "serving/index.html", "performance/index.html", "design/index.html", "misuse/index.html",
                 "benchmarks/index.html", "usage/python/index.html"):
        assert (site / page).is_file(), page
    assert "PrefillInputs" in (site / "design" / "index.html").read_text()


def test_strict_build_fails_on_a_broken_anchor(tmp_path, monkeypatch):
    """The site's validation settings turn a broken anchor into a failed build."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [serving](serving.md#no-such-heading).\n")
    (docs / "serving.md").write_text("# Serving\n")
    yml = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0]
    (tmp_path / "mkdocs.yml").write_text(yml + "\nnav:\n  - index.md\n  - serving.md\n")
    config = load_config(str(tmp_path / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    with pytest.raises(Abort, match="1 warnings"):
        build(config)


def test_design_step_input_tables_come_from_the_records():
    from neuronfx.config.inputs import describe

    page = (ROOT / "docs" / "design.md").read_text()
    block = page.split("<!-- step-inputs:begin -->\n")[1].split("\n<!-- step-inputs:end -->")[0]
    assert block == describe(), "regenerate docs/design.md's step-input tables with neuronfx.config.inputs.describe()"
