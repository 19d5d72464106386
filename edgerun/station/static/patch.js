// edgerun ground station: keyed redraws. A panel's children follow a list of [key, html] pairs: a child whose html
// did not change is kept as it is (its images decoded, its layout, a hover), a changed one is replaced, the gone
// removed, and the order follows the list. A redraw then costs the strings and the few elements that changed,
// not a rebuild of every row, marker and picture on each tick.
"use strict";

const PATCHED = new Map();  // parent element -> Map(key -> {el, html})

// Parses many html fragments at once (one parser call, not one per row), each of which is one element, in the
// namespace of its parent: rows of a tbody, groups of an SVG, blocks of a div.
function patchBuild(parent, htmls) {
  const t = document.createElement("template");
  const svg = parent instanceof SVGElement;
  const table = parent.tagName === "TBODY";
  // A <tr> or an SVG element alone would be parsed as text or HTML: wrap them where the parser expects them.
  t.innerHTML = svg ? `<svg xmlns="http://www.w3.org/2000/svg">${htmls.join("")}</svg>`
    : table ? `<table><tbody>${htmls.join("")}</tbody></table>` : htmls.join("");
  const box = svg ? t.content.firstElementChild : table ? t.content.firstElementChild.tBodies[0] : t.content;
  const els = [...box.children];
  if (els.length !== htmls.length) throw new Error(`patch: ${htmls.length} fragments made ${els.length} elements`);
  return els;
}

function patchChildren(parent, items) {
  const old = PATCHED.get(parent) || new Map();
  const next = new Map();
  const build = [];
  for (const [key, html] of items) {
    if (next.has(key)) continue;  // a key twice: the first stands
    const entry = old.get(key);
    if (entry && entry.html === html) next.set(key, entry);
    else { const fresh = { el: null, html }; next.set(key, fresh); build.push(fresh); }
  }
  if (build.length) patchBuild(parent, build.map((e) => e.html)).forEach((el, i) => { build[i].el = el; });
  // The replaced and the gone leave first, so one changed row does not shift every row after it.
  for (const [key, entry] of old) {
    const kept = next.get(key);
    if ((!kept || kept.el !== entry.el) && entry.el.parentNode === parent) parent.removeChild(entry.el);
  }
  // Walk the children once: an element in its place stays, others are moved in; what is left after is gone.
  let cursor = parent.firstChild;
  for (const entry of next.values()) {
    if (entry.el === cursor) cursor = cursor.nextSibling;
    else parent.insertBefore(entry.el, cursor);
  }
  while (cursor) { const gone = cursor; cursor = cursor.nextSibling; parent.removeChild(gone); }
  PATCHED.set(parent, next);
}

// Forgets what was drawn, so the next redraw builds every element afresh (a page's first draw; the benchmark's
// "cold" redraw).
function patchReset() {
  for (const parent of PATCHED.keys()) parent.replaceChildren();
  PATCHED.clear();
}
