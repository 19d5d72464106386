"""The page's keyed redraws (``edgerun/station/static/patch.js``) in headless Chromium: a row whose HTML did not
change is the same element after a redraw (its picture stays decoded), a changed one is replaced, new ones are
inserted in order, gone ones removed, a reorder moves rows, and SVG and table rows are made in their namespace."""

from __future__ import annotations

from importlib import resources

import pytest

from tests.integration.station_rig import browser, needs_chromium  # noqa: F401 (fixture)

pytestmark = needs_chromium

CHECKS = """
const tbody = document.createElement("tbody");
document.body.appendChild(document.createElement("table")).appendChild(tbody);
const row = (k, text) => [k, `<tr data-k="${k}"><td>${text}</td></tr>`];
const keys = () => [...tbody.children].map((r) => r.dataset.k + ":" + r.textContent);
patchChildren(tbody, [row("a", 1), row("b", 2), row("c", 3)]);
const first = [...tbody.children];
first.forEach((r) => { r.probe = true; });
const out = {};
out.built = keys();
patchChildren(tbody, [row("a", 1), row("b", 20), row("c", 3)]);  // b changed
out.changed = keys();
out.keptA = tbody.children[0] === first[0] && tbody.children[2] === first[2];
out.replacedB = tbody.children[1] !== first[1] && !tbody.children[1].probe;
patchChildren(tbody, [row("n", 0), row("c", 3), row("a", 1)]);  // new first, reordered, b gone
out.reordered = keys();
out.keptAfterMove = tbody.children[1] === first[2] && tbody.children[2] === first[0];
tbody.insertAdjacentHTML("beforeend", "<tr><td>stray</td></tr>");  // not drawn by patch: goes at the next redraw
patchChildren(tbody, [row("c", 3)]);
out.after = keys();
out.tagTr = tbody.children[0].tagName;
const svg = document.body.appendChild(document.createElementNS("http://www.w3.org/2000/svg", "svg"));
patchChildren(svg, [["c", '<circle r="3"/>'], ["g", '<g class="drone"><path d="M0,0 L1,1"/></g>']]);
out.svg = [...svg.children].map((e) => e.namespaceURI + " " + e.tagName);
patchReset();
out.reset = [tbody.children.length, svg.children.length];
patchChildren(tbody, [row("a", 1)]);
out.rebuilt = tbody.children[0] !== first[0];
return out;
"""


@pytest.mark.timeout(60)
def test_keyed_redraws_keep_what_did_not_change_and_replace_what_did(browser):  # noqa: F811
    script = (resources.files("edgerun.station") / "static" / "patch.js").read_text()
    browser.get("about:blank")
    out = browser.execute_script(script + CHECKS)
    svg = "http://www.w3.org/2000/svg"
    assert out == {
        "built": ["a:1", "b:2", "c:3"],
        "changed": ["a:1", "b:20", "c:3"],
        "keptA": True,
        "replacedB": True,
        "reordered": ["n:0", "c:3", "a:1"],
        "keptAfterMove": True,
        "after": ["c:3"],
        "tagTr": "TR",
        "svg": [f"{svg} circle", f"{svg} g"],
        "reset": [0, 0],
        "rebuilt": True,
    }
