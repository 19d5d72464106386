// edgerun ground station: alerts. A new fleet object alerts this page (a panel and, once the operator enabled it,
// a tone) until an operator acknowledges it here or on any other page or station. station.js hands every snapshot
// and delta to alertsApply(); the acknowledgement goes to POST /api/alerts/<id>/ack and comes back in a delta.
"use strict";

const A = { alerts: {}, audio: null, soundWanted: false, lastTone: 0, posting: new Set(), message: "", dirty: false };
const TONE_EVERY_MS = 4000;  // how often an unacknowledged find sounds again
const ACKED_SHOWN = 20;

function alertsApply(data, isSnapshot) {
  if (isSnapshot) A.alerts = {};
  for (const a of data.alerts || []) A.alerts[a.id] = a;
  for (const id of data.removed_objects || []) delete A.alerts[id];  // the station forgot the object (its bound)
  // A snapshot (the page's first message) is drawn at once; a delta only when an alert changed, in station.js's
  // next frame (alertsRedraw), not once per message.
  if (isSnapshot) alertsRender();
  else if ((data.alerts && data.alerts.length) || (data.removed_objects && data.removed_objects.length)) A.dirty = true;
}

function alertsRedraw() {
  if (A.dirty) alertsRender();
}

function alertsEl() {
  let box = document.getElementById("alerts");
  if (box) return box;
  box = document.createElement("section");
  box.id = "alerts";
  box.className = "alerts";
  box.innerHTML = `<div class="alerts-head"><h2>Alerts <span id="alert-count"></span></h2>
    <button id="alert-sound" type="button">enable sound</button><span id="alert-sound-state" class="muted"></span>
    <span id="alert-result" class="muted"></span></div>
    <div id="alert-list"></div>
    <details id="alert-acked-box" open><summary>acknowledged (<span id="alert-acked-count">0</span>)</summary>
    <ul id="alert-acked"></ul></details>`;
  const anchor = document.getElementById("banner");
  anchor.parentNode.insertBefore(box, anchor.nextSibling);
  document.getElementById("alert-sound").addEventListener("click", alertsToggleSound);
  box.addEventListener("click", (ev) => {
    const button = ev.target.closest("button[data-ack]");
    if (button) alertsAck(button.dataset.ack);
  });
  return box;
}

function alertsPlace(a) {
  if (a.lat !== null && a.lat !== undefined && a.lon !== null && a.lon !== undefined) {
    return `${Number(a.lat).toFixed(5)}, ${Number(a.lon).toFixed(5)}`;
  }
  if (a.east_m !== null && a.east_m !== undefined) return `E ${fmt(a.east_m)} m, N ${fmt(a.north_m)} m`;
  return "position unknown";
}

function alertsRender() {
  A.dirty = false;
  const box = alertsEl();
  const all = Object.values(A.alerts);
  const open = all.filter((a) => !a.acked_by).sort((x, y) => y.found - x.found);
  const acked = all.filter((a) => a.acked_by).sort((x, y) => y.acked_ts - x.acked_ts);
  box.classList.toggle("alerting", open.length > 0);
  document.getElementById("alert-count").textContent = open.length ? `${open.length} new` : "none new";
  const canAct = typeof S === "undefined" || S.canAct;
  A.renderedCanAct = canAct;
  const focus = decodeURIComponent((window.location.hash.match(/^#object=(.+)$/) || [])[1] || "");  // a webhook's link
  patchChildren(document.getElementById("alert-list"), open.map((a) => [a.id, `<div class="alert${a.id === focus ? " alert-focus" : ""}"
    data-object="${esc(a.id)}">
    ${a.image_url ? `<img class="alert-image" src="${esc(a.image_url)}" alt="picture of ${esc(a.label)}">` : ""}
    <div class="alert-text"><b>${esc(a.label)}</b> ${a.score !== null && a.score !== undefined ? fmt(a.score, 2) : ""}
    <span class="muted">${esc(a.id)}</span><br>${esc(alertsPlace(a))}<br>
    found ${clock(a.found)} by ${esc(a.owner || "?")}</div>
    <button type="button" class="alert-ack" data-ack="${esc(a.id)}" ${canAct && !A.posting.has(a.id) ? "" : "disabled"}>
    acknowledge</button></div>`]));
  document.getElementById("alert-acked-count").textContent = String(acked.length);
  patchChildren(document.getElementById("alert-acked"), acked.filter((a, i) => i < ACKED_SHOWN || a.id === focus).map((a) =>
    [a.id, `<li${a.id === focus ? ' class="alert-focus"' : ""} data-object="${esc(a.id)}" data-by="${esc(a.acked_by)}">${esc(a.label)} <span class="muted">${esc(a.id)}</span>
    acknowledged by <b>${esc(a.acked_by)}</b> at ${clock(a.acked_ts)}</li>`]));
  alertsSoundState();
  if (open.length) alertsTone();
}

// The objects table's alert column (station.js draws the table): new, or who acknowledged it and when.
function alertsCell(id) {
  const a = A.alerts[id];
  if (!a) return "-";
  if (!a.acked_by) return '<span class="badge b-dead">new</span>';
  return `<span title="acknowledged at ${clock(a.acked_ts)}">ack ${esc(a.acked_by)} ${clock(a.acked_ts)}</span>`;
}

// Browsers start audio only after a user gesture: the operator enables it once, and the page says whether it is on.
function alertsToggleSound() {
  if (!A.audio) {
    const Ctx = window.AudioContext || window.webkitAudioContext;
    if (!Ctx) { A.message = "this browser has no Web Audio"; alertsSoundState(); return; }
    A.audio = new Ctx();
  }
  A.soundWanted = !A.soundWanted || A.audio.state !== "running";
  const done = () => { alertsSoundState(); if (A.soundWanted) { A.lastTone = 0; alertsTone(true); } };
  if (A.soundWanted) A.audio.resume().then(done, done); else done();
}

function alertsSoundOn() { return A.soundWanted && A.audio !== null && A.audio.state === "running"; }

function alertsSoundState() {
  const on = alertsSoundOn();
  const state = document.getElementById("alert-sound-state");
  state.textContent = A.message || (on ? "sound is on" : "sound is off");
  state.dataset.sound = on ? "on" : "off";
  document.getElementById("alert-sound").textContent = on ? "mute" : "enable sound";
}

function alertsTone(force) {
  if (!alertsSoundOn()) return;
  const now = Date.now();
  if (!force && now - A.lastTone < TONE_EVERY_MS) return;
  A.lastTone = now;
  const ctx = A.audio, t = ctx.currentTime;
  for (const [start, freq] of [[0, 880], [0.25, 660]]) {  // two short beeps, a falling pair
    const osc = ctx.createOscillator(), gain = ctx.createGain();
    osc.type = "sine"; osc.frequency.value = freq;
    gain.gain.setValueAtTime(0.0001, t + start);
    gain.gain.exponentialRampToValueAtTime(0.3, t + start + 0.02);
    gain.gain.exponentialRampToValueAtTime(0.0001, t + start + 0.2);
    osc.connect(gain).connect(ctx.destination);
    osc.start(t + start); osc.stop(t + start + 0.22);
  }
}

async function alertsAck(id) {
  A.posting.add(id); alertsRender();
  const result = document.getElementById("alert-result");
  try {
    const csrf = typeof S !== "undefined" && S.csrf ? { "X-CSRF-Token": S.csrf } : {};
    const resp = await fetch(`/api/alerts/${encodeURIComponent(id)}/ack`, { method: "POST",
      headers: { "X-Edgerun-Confirm": id, ...csrf } });
    if (resp.status === 401) { window.location.assign("/login"); return; }
    const body = await resp.json().catch(() => ({}));
    result.textContent = resp.ok ? "" : `acknowledge ${id}: ${body.error || resp.status}`;
  } catch (err) {
    result.textContent = `acknowledge ${id}: ${err}`;
  } finally {
    A.posting.delete(id); alertsRender();
  }
}

window.addEventListener("hashchange", alertsRender);
setInterval(() => {
  if (typeof S !== "undefined" && A.renderedCanAct !== undefined && S.canAct !== A.renderedCanAct) alertsRender();
  if (Object.values(A.alerts).some((a) => !a.acked_by)) alertsTone();
}, 1000);
