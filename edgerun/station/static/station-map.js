// edgerun ground station: the geographic map (Leaflet, vendored; tiles only from the station's --tiles basemap).
// Reads the page state S of station.js; station.js calls geoRender() on each redraw and geoActive() to pick the view.
"use strict";

const GEO = { map: null, tiles: null, info: undefined, objects: null, drones: null, shapes: null, fitted: false,
  objectMarkers: {}, droneMarkers: {}, trails: {}, footprints: {}, clustered: false };

// Metres per degree of latitude and longitude at a latitude (the WGS84 ellipsoid's series; cm over a search area).
function metresPerDegree(latDeg) {
  const p = (latDeg * Math.PI) / 180;
  return [111132.92 - 559.82 * Math.cos(2 * p) + 1.175 * Math.cos(4 * p),
    111412.84 * Math.cos(p) - 93.5 * Math.cos(3 * p)];
}

// Where each node's local east/north frame sits on Earth. A node's poses are metres in its own frame; the objects
// it owns carry lat/lon and the same east/north, so they give that frame's origin. Nodes without an owned object
// use the fleet's (the demo's drones share one frame).
function frameAnchors() {
  const per = {}; let any = null;
  for (const o of Object.values(S.objects)) {
    if (o.lat == null || o.lon == null || o.east_m == null || o.north_m == null) continue;
    const anchor = frameOrigin(o.lat, o.lon, o.east_m, o.north_m);
    if (o.owner && !per[o.owner]) per[o.owner] = anchor;
    if (!any) any = anchor;
  }
  return { per, any };
}

// The origin of a local frame, from a point's lat/lon and its east/north in that frame.
function frameOrigin(lat, lon, east, north) {
  const [mlat, mlon] = metresPerDegree(lat);
  return [lat - north / mlat, lon - east / mlon];
}

function toLatLon(anchor, east, north) {
  const [mlat, mlon] = metresPerDegree(anchor[0]);
  return [anchor[0] + north / mlat, anchor[1] + east / mlon];
}

function geoAvailable() {
  return Object.values(S.objects).some((o) => o.lat != null && o.lon != null)
    || Object.values(S.nodes).some((n) => n.pose && n.pose.lat != null);
}

// The view: "geo" or "local" as the operator chose, else the map when the scene has a place on Earth.
function geoActive() {
  const mode = document.getElementById("map-mode").value;
  if (mode === "local" || typeof L === "undefined") return false;
  return mode === "geo" || geoAvailable() || !!(GEO.info && GEO.info.tiles);
}

async function geoInit() {
  if (GEO.map) return;
  GEO.map = L.map("geomap", { zoomControl: true, attributionControl: false, worldCopyJump: false,
    minZoom: 2, maxZoom: 22 });
  GEO.map.setView([0, 0], 2);
  GEO.shapes = L.layerGroup().addTo(GEO.map);
  GEO.clustered = typeof L.markerClusterGroup === "function";
  // Clusters where labels would overlap; every object apart again from zoom 19 (a few metres a pixel).
  GEO.objects = GEO.clustered ? L.markerClusterGroup({ disableClusteringAtZoom: 19, maxClusterRadius: 40 })
    : L.layerGroup();
  GEO.objects.addTo(GEO.map);
  GEO.drones = L.layerGroup().addTo(GEO.map);
  try {
    const resp = await fetch("/api/map", { cache: "no-store" });
    GEO.info = resp.ok ? await resp.json() : { tiles: null };
  } catch (err) { GEO.info = { tiles: null }; }
  const t = GEO.info.tiles;
  if (t) {
    // Below the basemap's own zooms it is not drawn (scaling its tiles down would take millions of them);
    // above, its deepest tiles are enlarged.
    const opts = { minZoom: t.minzoom, maxZoom: 22, maxNativeZoom: t.maxzoom, className: "basemap" };
    if (t.bounds) opts.bounds = [[t.bounds[1], t.bounds[0]], [t.bounds[3], t.bounds[2]]];
    GEO.tiles = L.tileLayer("/tiles/{z}/{x}/{y}", opts).addTo(GEO.map);
  }
  S.dirty = true;
}

function popupHtml(o) {
  const img = o.image_url ? `<img class="find-image" src="${esc(o.image_url)}" alt="${esc(o.label)} as seen by ${esc(o.owner)}">` : "";
  return `<div class="find" data-id="${esc(o.id)}"><b>${esc(o.label)}</b> · ${esc(o.owner || "?")}<br>
    first seen ${clock(o.first_seen)} · seen by ${o.seen_count} · score ${fmt(o.score, 2)}<br>
    ${fmt(o.lat, 6)}, ${fmt(o.lon, 6)} ± ${fmt(o.uncertainty_m, 1)} m${img ? `<br>${img}` : ""}</div>`;
}

function objectIcon(o) {
  const kind = o.label === "face" ? "face" : "other";
  return L.divIcon({ className: `geo-object geo-${kind}`, iconSize: [14, 14],
    html: `<span data-id="${esc(o.id)}" data-label="${esc(o.label)}" data-owner="${esc(o.owner)}"></span>` });
}

function droneIcon(id, nd) {
  const colour = { dead: "#e05050", stale: "#777", degraded: "#e0a030", stopped: "#888" }[nd.state] || "#4cd964";
  const yaw = Number(nd.pose.yaw_deg) || 0;
  return L.divIcon({ className: "geo-drone", iconSize: [26, 26], iconAnchor: [13, 13],
    html: `<svg width="26" height="26" viewBox="-13 -13 26 26" data-id="${esc(id)}" data-state="${esc(nd.state)}">
      <g transform="rotate(${yaw.toFixed(1)})"><path d="M0,-11 L7,8 L0,4 L-7,8 Z" fill="${colour}" stroke="#000"/></g></svg>
      <span class="geo-drone-label">${esc(id)}</span>` });
}

function geoRender() {
  if (!GEO.map) return;
  const { per, any } = frameAnchors();
  const bounds = [];
  // objects: kept by id, replaced when they move or change (a cluster group wants markers re-added to move them)
  const seen = new Set();
  for (const o of Object.values(S.objects)) {
    if (o.lat == null || o.lon == null) continue;
    seen.add(o.id);
    bounds.push([o.lat, o.lon]);
    const key = `${o.lat},${o.lon},${o.label},${o.owner},${o.seen_count},${o.image_url || ""}`;
    const old = GEO.objectMarkers[o.id];
    if (old && old.key === key) continue;
    if (old) GEO.objects.removeLayer(old.marker);
    // Above the drones: a find under a drone's icon must still take a click (the drone is in the nodes table too).
    const marker = L.marker([o.lat, o.lon], { icon: objectIcon(o), title: `${o.label} · ${o.owner}`, zIndexOffset: 1000 });
    marker.bindPopup(popupHtml(o), { maxWidth: 340 });
    GEO.objects.addLayer(marker);
    GEO.objectMarkers[o.id] = { marker, key };
  }
  for (const id of Object.keys(GEO.objectMarkers)) {
    if (!seen.has(id)) { GEO.objects.removeLayer(GEO.objectMarkers[id].marker); delete GEO.objectMarkers[id]; }
  }
  // drones, footprints and trails: each node's shapes are kept and moved, not rebuilt on every redraw
  const drones = new Set(), trails = new Set(), footprints = new Set();
  for (const [id, nd] of Object.entries(S.nodes)) {
    if (!nd.pose) continue;
    // A node that says where it is on Earth is drawn there, and its own frame (from that and its east/north)
    // places its trail and footprint; else the frame of the objects it owns, else the fleet's.
    const own = nd.pose.lat != null && nd.pose.lon != null;
    const anchor = own ? frameOrigin(nd.pose.lat, nd.pose.lon, nd.pose.east_m, nd.pose.north_m) : (per[id] || any);
    let here = null;
    if (own) here = [nd.pose.lat, nd.pose.lon];
    else if (anchor) here = toLatLon(anchor, nd.pose.east_m, nd.pose.north_m);
    if (!here) continue;
    drones.add(id);
    bounds.push(here);
    if (anchor) {
      const trail = (S.trails[id] || []).map((p) => toLatLon(anchor, p[0], p[1]));
      // Not interactive: a click on what lies inside a footprint (an object, the map) goes to it.
      if (trail.length > 1) {
        trails.add(id);
        geoShape(GEO.trails, id, trail, () => L.polyline(trail, { color: "#7fd1ff", opacity: 0.45, weight: 2,
          className: "geo-trail", interactive: false }));
      }
      if (nd.footprint && nd.state !== "dead") {
        footprints.add(id);
        const corners = nd.footprint.map((p) => toLatLon(anchor, p[0], p[1]));
        geoShape(GEO.footprints, id, corners, () => L.polygon(corners, { color: "#7fd1ff", weight: 1,
          fillOpacity: 0.08, className: "geo-footprint", interactive: false }));
      }
    }
    const key = `${nd.state},${fmt(nd.pose.yaw_deg, 0)}`;
    const old = GEO.droneMarkers[id];
    if (old && old.key === key) {
      const at = old.marker.getLatLng();
      if (at.lat !== here[0] || at.lng !== here[1]) old.marker.setLatLng(here);
      continue;
    }
    if (old) GEO.drones.removeLayer(old.marker);
    const marker = L.marker(here, { icon: droneIcon(id, nd), title: id });
    marker.on("click", () => select(id));
    GEO.drones.addLayer(marker);
    GEO.droneMarkers[id] = { marker, key };
  }
  for (const [kept, shown] of [[GEO.trails, trails], [GEO.footprints, footprints]]) {
    for (const id of Object.keys(kept)) if (!shown.has(id)) { GEO.shapes.removeLayer(kept[id].layer); delete kept[id]; }
  }
  for (const id of Object.keys(GEO.droneMarkers)) {
    if (!drones.has(id)) { GEO.drones.removeLayer(GEO.droneMarkers[id].marker); delete GEO.droneMarkers[id]; }
  }
  // The first view, once the map has a size: everything known, else the basemap's extent (until something comes).
  if (!GEO.fitted && GEO.map.getSize().x > 0) {
    const t = GEO.info && GEO.info.tiles;
    if (bounds.length) { GEO.map.fitBounds(bounds, { maxZoom: 19, padding: [30, 30] }); GEO.fitted = true; }
    else if (t && t.bounds) GEO.map.fitBounds([[t.bounds[1], t.bounds[0]], [t.bounds[3], t.bounds[2]]]);
  }
}

// One node's trail or footprint: made once, then given its new points only when they changed.
function geoShape(kept, id, points, make) {
  const key = points.map((p) => `${p[0].toFixed(7)},${p[1].toFixed(7)}`).join(" ");
  const old = kept[id];
  if (!old) { kept[id] = { layer: make().addTo(GEO.shapes), key }; return; }
  if (old.key !== key) { old.layer.setLatLngs(points); old.key = key; }
}

function geoFit() {
  if (!GEO.map) return;
  const pts = [...Object.values(GEO.objectMarkers), ...Object.values(GEO.droneMarkers)].map((m) => m.marker.getLatLng());
  if (pts.length) GEO.map.fitBounds(L.latLngBounds(pts), { maxZoom: 19, padding: [30, 30] });
}

function geoShow(on) {
  document.getElementById("geomap").classList.toggle("hidden", !on);
  document.getElementById("map").classList.toggle("hidden", on);
  if (on && GEO.map) GEO.map.invalidateSize();
}
