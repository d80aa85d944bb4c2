"""The documentation builds with Sphinx with warnings as errors (`python -m sphinx -W -b html docs
<out>`, what CI runs), its API reference holds every public name, and the README stays a front door.

One build per session (about 10 s of CPU: Sphinx, MyST and autodoc importing the package)."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hyper_parallel_ms

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
from hpms_api import home_of, public_modules  # noqa: E402  (the docs' own extension)

README_MAX_LINES = 250


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    """The docs built into a fresh folder (the build's output is printed on failure)."""
    out = tmp_path_factory.mktemp("docs_html")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(DOCS), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(f"sphinx build: {time.perf_counter() - start:.1f} s")
    assert done.returncode == 0, f"sphinx -W failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return out


def test_docs_build_with_warnings_as_errors(html):
    assert (html / "index.html").is_file() and (html / "api" / "index.html").is_file()
    for page in DOCS.glob("*.md"):
        assert (html / f"{page.stem}.html").is_file(), f"{page.name} is in no toctree"


def test_every_public_name_is_in_the_api_reference(html):
    missing = []
    for module_name in public_modules():
        module = importlib.import_module(f"hyper_parallel_ms.{module_name}")
        page = html / "api" / f"{module_name}.html"
        text = page.read_text() if page.is_file() else ""
        if not text:
            missing.append(f"docs/api/{module_name}.rst (the page of hyper_parallel_ms.{module_name})")
        for name in getattr(module, "__all__", ()):
            if f'id="hyper_parallel_ms.{module_name}.{name}"' not in text:
                missing.append(f"hyper_parallel_ms.{module_name}.{name}")
    index = (html / "api" / "index.html").read_text()
    for name in hyper_parallel_ms.__all__:
        home = home_of(name)
        link = f'href="{name}.html"' if home is None else f'href="{home}.html#hyper_parallel_ms.{home}.{name}"'
        if f"hyper_parallel_ms.{name}</span>" not in index or link not in index:
            missing.append(f"hyper_parallel_ms.{name} (top-level table, linking {link})")
    assert not missing, "not in the API reference:\n" + "\n".join(missing)


def test_readme_is_a_front_door_whose_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md is the front door: move details to docs/"
    for must in ("pip install -e .", "bash scripts/run_tp.sh", "bash scripts/test.sh", "```python"):
        assert must in text, must
    links = re.findall(r"\]\(((?:docs|examples|scripts|tests)/[^)#]+)", text)
    assert len(links) > 15, links
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_no_test_reads_the_readme_for_content_that_moved_to_docs():
    """Tables and examples that tests check live in docs/ (the README is a front door only)."""
    readers = [p.name for p in (ROOT / "tests").rglob("*.py")
               if p.name not in ("test_docs.py", "test_docs_examples.py") and '"README.md"' in p.read_text()]
    assert readers == [], readers
