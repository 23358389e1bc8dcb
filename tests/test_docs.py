"""The README and docs/ as a reader follows them: every relative link (and its #anchor) resolves inside
the repository, the README's recipe excerpt is the shipped recipe's, and the README's recipe commands
run as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from nxd_finetune.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks), duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", FENCE.sub("", text), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``doc`` that name no file under ``root``, or no heading of their file."""
    text = doc.read_text()
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if root.resolve() not in [file, *file.parents] or not file.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(root.resolve())}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_the_link_check_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `model.compile` flag, on CPU\n")
    doc = tmp_path / "README.md"
    doc.write_text("[ok](docs/a.md) [ok](docs/a.md#the-modelcompile-flag-on-cpu) [ok](#top) [web](https://x.org)\n"
                   "```bash\n[in code](nowhere.md)\n```\n# Top\n"
                   "[gone](docs/b.md) [bad anchor](docs/a.md#nope) ![img](../outside.png)\n")
    assert broken_links(doc, tmp_path) == ["docs/b.md: no such file in the repository",
                                           "docs/a.md#nope: no heading #nope in docs/a.md",
                                           "../outside.png: no such file in the repository"]


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_recipe_excerpt_is_the_shipped_recipe():
    """Every key the README's excerpt sets has the value `recipes/llama3-8b-lora.yaml` gives it."""
    (block,) = re.findall(r"```yaml\n(.*?)```", readme_section("A recipe"), re.S)
    shipped = yaml.safe_load((ROOT / "recipes" / "llama3-8b-lora.yaml").read_text())
    shown = yaml.safe_load(block)
    assert shown and set(shown) <= set(shipped)
    for section, keys in shown.items():
        for key, value in keys.items():
            assert shipped[section][key] == value, (section, key)


def test_readme_recipe_commands_run_as_written(capsys, monkeypatch, quickstart_cache):
    (block,) = re.findall(r"```bash\n(.*?)```", readme_section("A recipe"), re.S)
    commands = [shlex.split(line.split(" # ")[0]) for line in block.splitlines() if line.strip()]
    assert commands and all(argv[:2] == ["nxd-finetune", "validate"] for argv in commands)
    monkeypatch.chdir(ROOT)
    for argv in commands:
        with pytest.raises(SystemExit) as e:
            main(argv[1:])
        out = capsys.readouterr()
        assert e.value.code in (0, None), (argv, out.err)
        assert "memory" in out.out.lower(), out.out
