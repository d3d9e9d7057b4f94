"""The documentation: a short README whose links resolve, every docs page in the site's nav,
the site building with MkDocs (``--strict``: no broken link) where the ``docs`` extra is
installed (CI's main stage), and the README's tour running as written."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nav() -> list[str]:
    return re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 120
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert links and all((ROOT / link).is_file() for link in links), links


def test_every_page_is_in_the_nav_and_the_index_is_the_readme():
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(_nav()) == pages
    readme = (ROOT / "README.md").read_text().replace("](docs/", "](")
    assert (ROOT / "docs" / "index.md").read_text() == readme


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strictly(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "site" / "chip" / "index.html").is_file()


def test_the_readme_tour_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A tour", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "tour.py"
    script.write_text(tour)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                           "TORCHTPU_CACHE_DIR": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    out = run.stdout.splitlines()
    assert out[0].endswith("CPU (cpu)") and out[2] == "torch.bfloat16"
