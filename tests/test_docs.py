"""What the documentation states that the code also holds, checked so the two cannot drift apart: the tested releases
`trl-fp8 --version` prints (from `trl_fp8/stack.py`) and the documentation files the code, the tests and the READMEs
point to. MkDocs checks the links between the pages themselves (`mkdocs build --strict`)."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^ *(`{3,}|~{3,})")


def test_getting_started_states_the_tested_releases_that_trl_fp8_version_prints():
    from trl_fp8.cli.main import version_line

    (tested,) = [line for line in version_line().splitlines() if line.startswith("Tested on: ")]
    assert tested in (ROOT / "docs" / "getting-started.md").read_text(), (
        f"docs/getting-started.md, 'Tested releases', must quote `trl-fp8 --version`'s line as trl_fp8/stack.py makes "
        f"it: {tested}"
    )


def test_every_docs_file_the_code_and_the_tests_name_exists():
    named = {}
    for folder in ("trl_fp8", "benchmarks", "tests", "examples", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".yaml", ".toml") and "results" not in path.parts:
                for name in re.findall(r"\bdocs/[\w./-]+?\.md\b", path.read_text(errors="ignore")):
                    named.setdefault(name, path.relative_to(ROOT))
    assert named, "no docs path found: the scan is broken"
    missing = {name: str(where) for name, where in named.items() if not (ROOT / name).is_file()}
    assert not missing, missing


def _anchors(page: Path) -> set[str]:
    """The heading ids Python-Markdown's toc extension gives `page` (its default slugify), and explicit `<a id>`s."""
    anchors, fence = set(re.findall(r'<a id="([^"]+)"', page.read_text())), None
    for line in page.read_text().splitlines():
        if match := FENCE.match(line):
            fence = None if fence and match.group(1)[0] == fence[0] else (fence or match.group(1))
            continue
        if fence is None and (heading := re.match(r"#{1,6} (.+)", line)):
            text = re.sub(r"[`*]", "", heading.group(1))
            text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
            anchors.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower()))
    return anchors


def test_the_readmes_links_into_the_docs_reach_a_page_and_a_heading():
    broken = []
    for readme in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        for target in re.findall(r"\]\(([^)\s:]+\.md)(?:#([^)\s]+))?\)", readme.read_text()):
            page = (readme.parent / target[0]).resolve()
            if not page.is_file() or (target[1] and target[1] not in _anchors(page)):
                broken.append(f"{readme.relative_to(ROOT)}: {'#'.join(filter(None, target))}")
    assert not broken, broken
