"""The manual: README.md and the MkDocs site under docs/.

Their Python blocks run as tests through pytest-markdown-docs (pytest.ini);
these tests build the site as CI would and keep the text in shape.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

README_MAX_LINES = 200
README_FIRST_PYTHON_BY = 60
# Words about how the project is planned, which the manual has no use for.
PLANNING_WORDS = ("issue", "wave", "session")
# "issue" may stand in the address of a link to an upstream bug report;
# "session" in code (TF1's `tf.compat.v1.Session`).
URL = re.compile(r"https?://\S+")
CODE = re.compile(r"`[^`]*`")


def _pages():
    """Every Markdown page of the site, as paths relative to docs/."""
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def _nav_pages(nav):
    """The page paths a mkdocs.yml nav names, at any depth."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return []


def _mkdocs_config():
    # mkdocs.yml may hold !ENV or !relative tags; none of them matter for the nav.
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    with open(ROOT / "mkdocs.yml") as f:
        return yaml.load(f, Loader=Loader)


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, (
        f"mkdocs build --strict exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_readme_is_short_and_starts_with_code():
    lines = README.read_text(encoding="utf8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move the rest to docs/")
    fences = [i + 1 for i, line in enumerate(lines) if line.strip().startswith("```python")]
    assert fences, "README.md has no ```python block"
    assert fences[0] <= README_FIRST_PYTHON_BY, (
        f"README.md's first ```python block opens on line {fences[0]}, "
        f"not within the first {README_FIRST_PYTHON_BY}")


def test_every_page_is_in_the_nav():
    nav = _nav_pages(_mkdocs_config().get("nav"))
    missing = [page for page in _pages() if page not in nav]
    assert not missing, f"pages under docs/ missing from mkdocs.yml's nav: {missing}"
    absent = [page for page in nav if page not in _pages()]
    assert not absent, f"mkdocs.yml's nav names pages that do not exist: {absent}"


def test_no_planning_words():
    found = []
    for path in [README] + sorted(DOCS.rglob("*.md")):
        for number, line in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
            for word in PLANNING_WORDS:
                text = {"issue": URL.sub(" ", line), "session": CODE.sub(" ", line)}.get(word, line)
                if re.search(rf"\b{word}\b", text, re.IGNORECASE):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {word!r} in {line.strip()!r}")
    assert not found, "words about planning, not about the library:\n" + "\n".join(found)
