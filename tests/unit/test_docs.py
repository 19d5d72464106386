"""The README and docs/ agree with the code: config sections and keys, links, the version in one place.

`make docs` (mkdocs --strict) checks the links inside docs/; README.md lives outside docs/, so its
links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

import edgerun
from edgerun.config import Config

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def config_sections(struct: type = Config, prefix: str = "") -> dict[str, list[str]]:
    """Section path -> its keys, for every section (nested ones too) the Config structs define."""
    sections: dict[str, list[str]] = {}
    for field in msgspec.structs.fields(struct):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            sections.update(config_sections(field.type, f"{prefix}{field.name}."))
        else:
            sections.setdefault(prefix.rstrip("."), []).append(field.name)
    return {name: keys for name, keys in sections.items() if name}


def heading_anchors(markdown: str) -> set[str]:
    """The ids GitHub and Python-Markdown's toc give headings (lower case, punctuation dropped, spaces to -)."""
    anchors, in_code = set(), False
    for line in markdown.splitlines():
        in_code ^= line.startswith("```")  # a "# comment" in a shell block is no heading
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            text = re.sub(r"[^\w\s-]", "", m.group(1).lower()).strip()
            anchors.add(re.sub(r"[-\s]+", "-", text))
    return anchors


def test_config_sections_are_all_found():
    assert {"ota", "swarm", "swarm.timing", "mcu", "source.pose", "sinks.mqtt"} <= set(config_sections())


def test_readme_lists_every_config_section():
    readme = README.read_text()
    missing = [name for name in config_sections() if f"`[{name}]`" not in readme]
    assert not missing, f"README.md's configuration section lacks {missing}"


def test_configuration_page_documents_every_key():
    page = (REPO / "docs" / "configuration.md").read_text()
    tables = dict(re.findall(r"### `\[([\w.]+)\]`\n\n(.*?)(?=\n### |\Z)", page, re.S))
    for section, keys in config_sections().items():
        assert section in tables, f"docs/configuration.md has no table for [{section}]"
        missing = [key for key in keys if f"| `{key}` |" not in tables[section]]
        assert not missing, f"docs/configuration.md [{section}] lacks {missing}"


@pytest.mark.parametrize("page", ["README.md", "deploy/README.md", "CHANGELOG.md"])
def test_relative_links_resolve(page):
    source = REPO / page
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an external URL
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        assert resolved.exists(), f"{page}: link to {target}: no such file"
        if anchor and resolved.suffix == ".md":
            assert anchor in heading_anchors(resolved.read_text()), f"{page}: link to {target}: no such heading"


def test_version_in_one_place():
    version = edgerun.__version__
    setup_cfg = (REPO / "setup.cfg").read_text()
    assert re.search(r"^version = attr: edgerun.__version__$", setup_cfg, re.M)
    # balena reads balena.yml as plain YAML and cannot import the package: it must say the same version.
    balena = (REPO / "deploy" / "balena" / "balena.yml").read_text()
    assert re.search(rf"^version: {re.escape(version)}$", balena, re.M), "deploy/balena/balena.yml: version"
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\]", changelog, re.M), f"CHANGELOG.md has no [{version}] entry"
