// edgerun ground station page: one server-sent-events stream (a snapshot, then deltas), drawn at most 5 times a second,
// in an animation frame, redrawing only the rows and shapes that changed (patch.js).
"use strict";

const S = { nodes: {}, objects: {}, events: [], rollouts: {}, broker: null, readOnly: true, ground: null, truth: [],
  mqtt: "", staleS: 15, trails: {}, bounds: null, selected: null, dirty: true, streamUp: false, asOf: 0,
  login: false, user: null, csrf: null, canAct: true };
const TRAIL_POINTS = 300;
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
  '"': "&quot;", "'": "&#39;" }[c]));
const fmt = (v, d = 1) => (v === null || v === undefined || Number.isNaN(v) ? "-" : Number(v).toFixed(d));
// One formatter for every time on the page: toLocaleTimeString makes a new one per call, and a page of 200
// finds calls it a thousand times a redraw (what toLocaleTimeString([], { hour12: false }) would use).
const CLOCK = new Intl.DateTimeFormat([], { hour: "numeric", minute: "numeric", second: "numeric", hour12: false });
const clock = (ts) => (ts ? CLOCK.format(new Date(ts * 1000)) : "-");

function applySnapshot(snap) {
  S.nodes = snap.nodes || {};
  S.objects = {};
  for (const o of snap.objects || []) S.objects[o.id] = o;
  S.events = (snap.events || []).slice(-300);
  S.broker = snap.broker; S.readOnly = snap.read_only; S.ground = snap.ground; S.truth = snap.truth || [];
  S.mqtt = snap.mqtt; S.staleS = snap.stale_s || 15; S.rollouts = snap.rollouts || {}; S.asOf = snap.ts;
  S.trails = {};
  for (const [id, n] of Object.entries(S.nodes)) S.trails[id] = (n.trail || []).map((p) => [p[0], p[1], 0]);
  S.bounds = null;
  S.dirty = true; renderRollouts();
  if (typeof alertsApply === "function") alertsApply(snap, true);  // alerts.js
}

function applyDelta(d) {
  S.asOf = d.ts;
  for (const [id, n] of Object.entries(d.nodes || {})) {
    S.nodes[id] = n;
    if (n.pose) {
      const t = S.trails[id] || (S.trails[id] = []);
      const last = t[t.length - 1];
      if (!last || d.ts - last[2] >= 1) t.push([n.pose.east_m, n.pose.north_m, d.ts]);
      if (t.length > TRAIL_POINTS) t.splice(0, t.length - TRAIL_POINTS);
    }
  }
  for (const id of d.removed_nodes || []) { delete S.nodes[id]; delete S.trails[id]; }
  for (const o of d.objects || []) S.objects[o.id] = o;
  for (const id of d.removed_objects || []) delete S.objects[id];
  if (d.events) { S.events.push(...d.events); if (S.events.length > 300) S.events.splice(0, S.events.length - 300); }
  if (d.broker) S.broker = d.broker;
  S.dirty = true;
  if (typeof alertsApply === "function") alertsApply(d, false);  // alerts.js
}

// -- the operator's session: who is logged in, and the CSRF token every POST carries ---------------------------

async function loadSession() {
  try {
    const resp = await fetch("/api/session", { cache: "no-store" });
    if (resp.status === 401) { window.location.assign("/login"); return; }
    const s = await resp.json();
    S.login = s.login; S.user = s.user; S.csrf = s.csrf; S.canAct = s.can_act;
  } catch (err) { return; }
  $("who").textContent = S.user ? `operator ${S.user}` : "";
  $("logout").classList.toggle("hidden", !S.user);
  $("login-link").classList.toggle("hidden", !S.login || !!S.user);
  renderRollouts(); S.dirty = true;
}

async function logout() {
  await fetch("/logout", { method: "POST", headers: { "X-CSRF-Token": S.csrf || "" } }).catch(() => null);
  window.location.assign("/login");
}

function connect() {
  const es = new EventSource("/api/stream");
  es.addEventListener("snapshot", (e) => { S.streamUp = true; applySnapshot(JSON.parse(e.data)); });
  es.addEventListener("delta", (e) => applyDelta(JSON.parse(e.data)));
  es.addEventListener("rollouts", (e) => { const d = JSON.parse(e.data); S.rollouts = d.rollouts; S.readOnly = d.read_only;
    renderRollouts(); S.dirty = true; });
  es.onerror = () => {
    S.streamUp = false; S.dirty = true;  // EventSource reconnects by itself, unless the station refused it
    if (es.readyState === EventSource.CLOSED) { loadSession(); setTimeout(connect, 2000); }
  };
}

// -- map ------------------------------------------------------------------------------------------------------

function growBounds() {
  let b = S.bounds ? [...S.bounds] : [Infinity, Infinity, -Infinity, -Infinity];
  const add = (e, n) => { if (Number.isFinite(e) && Number.isFinite(n)) {
    b[0] = Math.min(b[0], e); b[1] = Math.min(b[1], n); b[2] = Math.max(b[2], e); b[3] = Math.max(b[3], n); } };
  if (S.ground) { const x = S.ground.extent; add(x[0], x[1]); add(x[2], x[3]); }
  for (const t of S.truth) { add(t.box_m[0], t.box_m[1]); add(t.box_m[2], t.box_m[3]); }
  for (const n of Object.values(S.nodes)) {
    if (n.pose) add(n.pose.east_m, n.pose.north_m);
    for (const p of n.footprint || []) add(p[0], p[1]);
  }
  for (const o of Object.values(S.objects)) if (o.east_m != null) add(o.east_m, o.north_m);
  if (!Number.isFinite(b[0])) b = [-10, -10, 10, 10];
  S.bounds = b;
}

function niceLength(m) {
  const p = Math.pow(10, Math.floor(Math.log10(m)));
  for (const k of [5, 2, 1]) if (k * p <= m) return k * p;
  return p;
}

function renderMap() {
  const svg = $("map");
  const W = svg.clientWidth || 800, H = svg.clientHeight || 500, pad = 30;
  growBounds();
  const [w, s, e, n] = S.bounds;
  const span = Math.max(e - w, n - s, 1);
  const scale = Math.min((W - 2 * pad) / Math.max(e - w, 1e-3), (H - 2 * pad) / Math.max(n - s, 1e-3), 400);
  const ox = pad + ((W - 2 * pad) - (e - w) * scale) / 2, oy = pad + ((H - 2 * pad) - (n - s) * scale) / 2;
  const X = (east) => (ox + (east - w) * scale).toFixed(1);
  const Y = (north) => (oy + (n - north) * scale).toFixed(1);
  const out = [];  // [key, one element's html]
  const put = (key, html) => out.push([key, html]);
  if (S.ground) {
    const g = S.ground.extent;
    put("ground", `<image href="${esc(S.ground.url)}" x="${X(g[0])}" y="${Y(g[3])}" width="${((g[2] - g[0]) * scale).toFixed(1)}"
      height="${((g[3] - g[1]) * scale).toFixed(1)}" preserveAspectRatio="none" opacity="0.75"/>`);
  }
  // a 1-2-5 grid under everything
  const step = niceLength(span / 6);
  for (let x = Math.ceil(w / step) * step; x <= e; x += step)
    put(`gx${x}`, `<line x1="${X(x)}" y1="${Y(s)}" x2="${X(x)}" y2="${Y(n)}" stroke="#222a33" stroke-width="1"/>`);
  for (let y = Math.ceil(s / step) * step; y <= n; y += step)
    put(`gy${y}`, `<line x1="${X(w)}" y1="${Y(y)}" x2="${X(e)}" y2="${Y(y)}" stroke="#222a33" stroke-width="1"/>`);
  S.truth.forEach((t, i) => {
    const [a, b, c, d] = t.box_m;
    put(`truth${i}`, `<rect class="truth" data-label="${esc(t.label)}" x="${X(a)}" y="${Y(d)}" width="${((c - a) * scale).toFixed(1)}"
      height="${((d - b) * scale).toFixed(1)}" fill="none" stroke="#5aa0ff" stroke-dasharray="4 3" stroke-width="1.5"/>`);
  });
  const labels = $("show-labels").checked && Object.keys(S.objects).length <= 80;
  for (const o of Object.values(S.objects)) {
    if (o.east_m == null || o.north_m == null) continue;  // lat/lon only: no place on the local map
    const r = Math.max(4, (o.uncertainty_m || 0) * scale);
    const colour = o.label === "face" ? "#ffd34d" : "#ff7ad9";
    const text = `${o.label} · ${o.owner || "?"} · ${clock(o.first_seen)} · ×${o.seen_count}`;
    put(`o:${o.id}`, `<g class="object" data-id="${esc(o.id)}" data-label="${esc(o.label)}" data-owner="${esc(o.owner)}"
      data-seen="${o.seen_count}" data-east="${o.east_m}" data-north="${o.north_m}"><title>${esc(text)}</title>
      <circle cx="${X(o.east_m)}" cy="${Y(o.north_m)}" r="${r.toFixed(1)}" fill="${colour}" fill-opacity="0.18" stroke="${colour}"/>
      <circle cx="${X(o.east_m)}" cy="${Y(o.north_m)}" r="3" fill="${colour}"/>
      ${labels ? `<text x="${(+X(o.east_m) + 6).toFixed(1)}" y="${(+Y(o.north_m) - 6).toFixed(1)}" fill="${colour}" font-size="11">${esc(text)}</text>` : ""}</g>`);
  }
  for (const [id, nd] of Object.entries(S.nodes)) {
    const trail = S.trails[id] || [];
    if (trail.length > 1) put(`t:${id}`, `<polyline class="trail" points="${trail.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ")}"
      fill="none" stroke="#7fd1ff" stroke-opacity="0.35" stroke-width="1.5"/>`);
    if (nd.footprint && nd.state !== "dead")
      put(`f:${id}`, `<polygon class="footprint" data-id="${esc(id)}" points="${nd.footprint.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ")}"
        fill="#7fd1ff" fill-opacity="0.08" stroke="#7fd1ff" stroke-opacity="0.6"/>`);
  }
  for (const [id, nd] of Object.entries(S.nodes)) {
    if (!nd.pose) continue;
    const colour = { dead: "#e05050", stale: "#777", degraded: "#e0a030", stopped: "#888" }[nd.state] || "#4cd964";
    const sel = S.selected === id ? `<circle r="14" fill="none" stroke="#fff" stroke-width="1.5"/>` : "";
    const mark = nd.state === "dead" ? `<path d="M-7,-7 L7,7 M7,-7 L-7,7" stroke="#fff" stroke-width="2"/>` : "";
    put(`d:${id}`, `<g class="drone" data-id="${esc(id)}" data-state="${esc(nd.state)}" data-east="${nd.pose.east_m}"
      data-north="${nd.pose.north_m}" transform="translate(${X(nd.pose.east_m)},${Y(nd.pose.north_m)})">${sel}
      <g transform="rotate(${fmt(nd.pose.yaw_deg, 1)})"><path d="M0,-11 L7,8 L0,4 L-7,8 Z" fill="${colour}" stroke="#000"/></g>${mark}
      <text x="10" y="-8" fill="#fff" font-size="12">${esc(id)}</text></g>`);
  }
  // scale bar, bottom left
  const bar = niceLength(((W - 2 * pad) / scale) / 5);
  const bx = pad, by = H - 12;
  put("scalebar", `<g id="scalebar" data-metres="${bar}"><line x1="${bx}" y1="${by}" x2="${(bx + bar * scale).toFixed(1)}" y2="${by}" stroke="#fff" stroke-width="3"/>
    <text x="${bx}" y="${by - 6}" fill="#fff" font-size="12">${bar} m</text></g>`);
  put("north", `<g id="north-arrow"><text x="${W - 18}" y="22" fill="#fff" font-size="14" text-anchor="middle">N</text>
    <path d="M${W - 18},26 l-5,12 l5,-3 l5,3 z" fill="#fff"/></g>`);
  const box = `0 0 ${W} ${H}`;
  if (svg.getAttribute("viewBox") !== box) svg.setAttribute("viewBox", box);
  patchChildren(svg, out);
}

// -- tables ---------------------------------------------------------------------------------------------------

function cohortOf(id) {
  for (const r of Object.values(S.rollouts)) if (r.cohort && r.cohort[id] && r.phase !== "halted") return r;
  return null;
}

function renderNodes() {
  const now = Date.now() / 1000;
  const rows = Object.values(S.nodes).sort((a, b) => a.id.localeCompare(b.id)).map((nd) => {
    const reasons = Object.entries(nd.reasons || {}).map(([k, v]) => `${k}: ${v}`).join("; ");
    const canary = cohortOf(nd.id);
    const swarm = nd.swarm_seen === null || nd.swarm_seen === undefined ? "-" : nd.swarm_seen;
    const gone = ["dead", "stale", "stopped"].includes(nd.state);  // what the table shows is the last it heard
    return [`n:${nd.id}`, `<tr data-id="${esc(nd.id)}" data-state="${esc(nd.state)}" class="state-${esc(nd.state)}">
      <td>${esc(nd.id)}${nd.via_swarm ? '<span class="badge b-stale" title="not heard on the broker: from its peers\' gossip">via swarm</span>' : ""}${canary ? `<span class="badge b-canary" title="in the ${canary.percent}% cohort of ${esc(canary.model)} v${canary.version}">canary</span>` : ""}</td>
      <td><span class="badge b-${esc(nd.state)}">${esc(nd.state === "dead" ? "DEAD" : nd.state)}</span></td>
      <td>${gone ? '<span class="muted">last: ' : ""}${esc(nd.health || "-")}${gone ? "</span>" : ""}${reasons ? ` <span class="muted">(${esc(reasons)})</span>` : ""}</td>
      <td>${esc(nd.engine || "-")}${nd.fallback ? '<span class="badge b-fallback">fallback</span>' : ""}</td>
      <td class="model">${nd.model ? `${esc(nd.model)} v${esc(nd.model_version)}` : "-"}</td>
      <td class="num fps">${fmt(nd.fps)}</td><td class="num">${fmt(nd.p99_ms)}</td>
      <td class="num">${nd.dropped ?? "-"}</td><td class="num">${esc(swarm)}</td>
      <td>${nd.last_seen ? `${fmt(Math.max(0, now - nd.last_seen), 0)} s ago` : "-"}</td>
      <td><button class="retire" data-retire="${esc(nd.id)}" ${S.canAct ? 'title="take it off the fleet view; it comes back if it speaks again"' : 'disabled title="log in to act"'}>retire</button></td></tr>`];
  });
  patchChildren($("nodes").tBodies[0], rows.length ? rows
    : [["none", `<tr><td colspan="11" class="muted">no node heard yet</td></tr>`]]);
  const objects = Object.values(S.objects).sort((a, b) => (b.last_seen || 0) - (a.last_seen || 0)).slice(0, 200);
  const alertCell = typeof alertsCell === "function" ? alertsCell : () => "";  // alerts.js: new, or who acknowledged
  patchChildren($("objects").tBodies[0], objects.map((o) => [o.id, `<tr data-id="${esc(o.id)}"><td>${esc(o.label)}</td>
    <td class="alert-state">${alertCell(o.id)}</td>
    <td>${esc(o.owner || "-")}</td><td>${clock(o.first_seen)}</td><td class="num">${o.seen_count}</td>
    <td class="latlon">${o.lat != null ? `${o.lat.toFixed(6)}, ${o.lon.toFixed(6)}` : "-"}</td>
    <td>${o.east_m != null ? `${fmt(o.east_m)}, ${fmt(o.north_m)}` : "-"}</td></tr>`]));
  $("object-count").textContent = `(${Object.keys(S.objects).length})`;
  // Events have no id: the same event twice (same time, node and text) is told apart by its count.
  const times = new Map();
  patchChildren($("events").tBodies[0], S.events.slice(-200).reverse().map((ev) => {
    const html = `<tr class="level-${esc(ev.level)}">
    <td>${clock(ev.ts)}</td><td>${esc(ev.node)}</td><td>${esc(ev.kind)}</td><td>${esc(ev.text)}</td></tr>`;
    const n = (times.get(html) || 0) + 1;
    times.set(html, n);
    return [`${n}:${html}`, html];
  }));
}

function renderHeader() {
  const nodes = Object.values(S.nodes);
  const count = (st) => nodes.filter((n) => n.state === st).length;
  $("summary").textContent = `${nodes.length} nodes: ${count("running")} running, ${count("degraded")} degraded, ` +
    `${count("stale")} stale, ${count("dead")} dead · ${Object.keys(S.objects).length} objects · mqtt://${S.mqtt}`;
  $("mode").innerHTML = S.readOnly ? '<span class="badge b-stale" title="start the station with --signing-key to act">read-only</span>'
    : '<span class="badge b-canary">rollout control armed</span>';
  const banner = $("banner");
  let text = "";
  if (!S.streamUp) text = "Lost the station; reconnecting…";
  else if (S.broker && !S.broker.connected)
    text = `Broker mqtt://${S.mqtt} unreachable (${S.broker.reason}); reconnecting. What you see is as of ${clock(S.broker.since)}.`;
  banner.textContent = text;
  banner.classList.toggle("hidden", !text);
}

// -- rollouts -------------------------------------------------------------------------------------------------

function renderRollouts() {
  const list = Object.values(S.rollouts);
  if (!list.length) { $("rollout-list").innerHTML = '<p class="muted">no release on the broker</p>'; return; }
  const dis = S.readOnly ? 'disabled title="read-only: start the station with --signing-key"'
    : !S.canAct ? `disabled title="${S.login ? "log in to act" : "read-only view"}"` : "";
  const halted = 'disabled title="a halted release is never taken again: publish a new version"';
  $("rollout-list").innerHTML = list.map((r) => {
    if (r.error) return `<div class="rollout">${esc(r.model)}: unreadable release (${esc(r.error)})</div>`;
    // A release that did not verify against the root keys is no release: shown as what it is, with no action.
    if (r.trust === "forged" || r.trust === "replayed")
      return `<div class="rollout" data-model="${esc(r.model)}" data-trust="${esc(r.trust)}">
        <b>${esc(r.model)} v${r.version}</b> · <span class="badge b-dead">${esc(r.trust_code === "expired" ? "EXPIRED" : r.trust.toUpperCase())}</span>
        not a release: nodes refuse it and the station will not sign it
        <div class="why">${esc(r.trust_reason)}</div></div>`;
    const v = r.verdict || {};
    const fig = Object.entries(v.figures || {}).map(([k, x]) => `${k} ${x}`).join(", ");
    const active = r.phase === "canary" || r.phase === "promoted";
    return `<div class="rollout" data-model="${esc(r.model)}" data-phase="${esc(r.phase)}" data-percent="${r.percent}">
      <b>${esc(r.model)} v${r.version}</b> · <span class="phase">${esc(r.phase === "complete" && !(r.nodes && r.nodes_on_version === r.nodes) ? "released" : r.phase)}</span> at ${r.percent}% ·
      <span class="progress">${esc(r.progress || `${r.nodes_on_version} of ${r.nodes} nodes on it`)}</span>${r.by ? ` · by ${esc(r.by)}` : ""}
      ${r.trust === "unverified" ? ` · <span class="badge b-stale" title="${esc(r.trust_reason)}">UNVERIFIED</span>` : ""}
      ${r.state_error ? `<div class="why">${esc(r.state_error)}</div>` : ""}
      ${r.reason ? `<div class="why">${esc(r.reason)}</div>` : ""}
      ${v.halt && active ? `<div class="why">canary regression: ${esc(v.reason)}</div>` : ""}
      <div class="muted">${esc(fig)}</div>
      <div><button data-act="promote" data-percent="50" ${dis} ${r.phase === "halted" ? halted : ""}>promote 50%</button>
      <button data-act="promote" data-percent="100" ${dis} ${r.phase === "halted" ? halted : ""}>promote 100%</button>
      <button class="danger" data-act="halt" ${dis} ${r.phase === "halted" ? "disabled" : ""}>halt</button></div></div>`;
  }).join("");
}

async function act(model, action, percent) {
  const r = S.rollouts[model];
  const what = action === "halt" ? `HALT the rollout of ${model} v${r.version}? No further node will take it.`
    : `Promote ${model} v${r.version} to ${percent}% of the fleet?`;
  if (!window.confirm(what)) return;
  $("action-result").textContent = "sending…";
  try {
    const resp = await fetch(`/api/rollouts/${encodeURIComponent(model)}/${action}`, { method: "POST",
      headers: { "Content-Type": "application/json", "X-Edgerun-Confirm": model, ...(S.csrf ? { "X-CSRF-Token": S.csrf } : {}) },
      body: JSON.stringify({ percent }) });
    if (resp.status === 401) { window.location.assign("/login"); return; }
    const body = await resp.json();
    $("action-result").textContent = resp.ok ? `${model}: ${body.state.phase} at ${body.state.percent}%` : `refused: ${body.error}`;
  } catch (err) { $("action-result").textContent = `failed: ${err}`; }
}

// -- snapshot of one node -------------------------------------------------------------------------------------

function select(id) {
  S.selected = id; S.dirty = true;
  $("snapshot-panel").classList.remove("hidden");
  $("snapshot-title").textContent = `Snapshot: ${id}`;
  refreshSnapshot();
}

async function refreshSnapshot() {
  const id = S.selected;
  if (!id) return;
  try {
    const resp = await fetch(`/api/nodes/${encodeURIComponent(id)}/snapshot.jpg?t=${Date.now()}`);
    if (!resp.ok) { $("snapshot-caption").textContent = `no snapshot (${resp.status})`; return; }
    const how = resp.headers.get("X-Edgerun-Snapshot");
    const url = URL.createObjectURL(await resp.blob());
    const img = $("snapshot"); const old = img.src; img.src = url; img.dataset.kind = how || "";
    if (old.startsWith("blob:")) URL.revokeObjectURL(old);
    $("snapshot-caption").textContent = how === "live" ? "live from the node" : "node not reachable: its last boxes on a blank frame";
  } catch (err) { $("snapshot-caption").textContent = `snapshot failed: ${err}`; }
}

// -- wiring ---------------------------------------------------------------------------------------------------

async function retire(id) {
  if (!window.confirm(`Retire ${id}? It leaves the fleet view on every station until it speaks again.`)) return;
  $("action-result").textContent = "sending…";
  try {
    const resp = await fetch(`/api/nodes/${encodeURIComponent(id)}/retire`, { method: "POST",
      headers: { "X-Edgerun-Confirm": id, ...(S.csrf ? { "X-CSRF-Token": S.csrf } : {}) } });
    if (resp.status === 401) { window.location.assign("/login"); return; }
    const body = await resp.json();
    $("action-result").textContent = resp.ok ? `${id}: retired` : `refused: ${body.error}`;
  } catch (err) { $("action-result").textContent = `failed: ${err}`; }
}

document.addEventListener("click", (ev) => {
  const gone = ev.target.closest("button[data-retire]");
  if (gone) { retire(gone.dataset.retire); return; }
  const btn = ev.target.closest("button[data-act]");
  if (btn) { const box = btn.closest(".rollout"); act(box.dataset.model, btn.dataset.act, Number(btn.dataset.percent || 0)); return; }
  const node = ev.target.closest("#nodes tbody tr[data-id], .drone[data-id]");
  if (node) select(node.dataset.id);
});
$("logout").addEventListener("click", logout);
$("fit").addEventListener("click", () => { S.bounds = null; S.dirty = true; if (typeof geoFit === "function") geoFit(); });
$("show-labels").addEventListener("change", () => { S.dirty = true; });
$("map-mode").addEventListener("change", () => { S.dirty = true; });
window.addEventListener("resize", () => { S.dirty = true; });
function renderMaps() {
  // The geographic map when the scene has a place on Earth (station-map.js); the local-metres SVG stays drawn
  // beneath it for scenes that have none, and as the operator's choice.
  const geo = typeof geoActive === "function" && geoActive();
  if (typeof geoShow === "function") geoShow(geo);
  if (geo) geoRender();
  renderMap();
}
// At most every 200 ms, and in an animation frame: a hidden tab draws nothing, and one frame draws every change
// that came since (the stream's deltas and the alerts' marks together).
let framePending = false;
function redraw() {
  framePending = false;
  if (S.dirty) { S.dirty = false; renderMaps(); renderNodes(); renderHeader(); }
  if (typeof alertsRedraw === "function") alertsRedraw();  // alerts.js: only when an alert changed
}
setInterval(() => { if (!framePending) { framePending = true; requestAnimationFrame(redraw); } }, 200);
setInterval(() => { S.dirty = true; }, 1000);  // ages and stale marks move with the clock
setInterval(refreshSnapshot, 2000);
loadSession();
if (typeof geoInit === "function" && typeof L !== "undefined") geoInit();
connect();
