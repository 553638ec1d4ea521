"""The docs describe the tree they sit in: docs/codemap.md is what scripts/codemap.py generates from
the modules now, every module has a docstring for it to show, and every relative link in README.md
and docs/*.md leads to a file that exists."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "scripts" / "codemap.py"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _codemap():
    spec = importlib.util.spec_from_file_location("codemap", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_codemap_is_current():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_codemap_check_fails_on_a_stale_map(tmp_path, monkeypatch):
    cm = _codemap()
    stale = tmp_path / "codemap.md"
    stale.write_text("# Code map\n\nan older tree\n", encoding="utf-8")
    monkeypatch.setattr(cm, "OUT", stale)
    monkeypatch.setattr(cm, "ROOT", tmp_path)
    monkeypatch.setattr(cm, "GROUPS", ())
    assert cm.main(["--check"]) == 1
    assert cm.main([]) == 0 and cm.main(["--check"]) == 0


def test_every_module_has_a_docstring():
    cm = _codemap()
    groups = cm.collect()
    assert sum(len(mods) for _, _, pkgs in groups for _, mods in pkgs) > 50
    missing = cm.undocumented(groups)
    assert not missing, "modules without a docstring (give each one saying why it exists):\n  " + "\n  ".join(missing)


def test_first_sentence():
    cm = _codemap()
    assert cm.first_sentence("Places sandboxes. Then more.") == "Places sandboxes."
    assert cm.first_sentence("Moves images, e.g. from Docker.\n\nDetails.") == "Moves images, e.g. from Docker."
    assert cm.first_sentence("no period\nat all") == "no period at all"


def _links(md: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", md.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def _anchors(md: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-") for h in heads}


def test_relative_links_point_to_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 6, pages  # README + architecture, codemap, contract, operations, benchmarks, integrations
    broken, checked = [], 0
    for page in pages:
        for target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # a URL
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 100, checked  # the code map alone links every module
    assert not broken, "links to files or headings that do not exist:\n  " + "\n  ".join(broken)
