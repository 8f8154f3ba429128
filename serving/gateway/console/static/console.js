// The console's shared code: JSON fetches, formatting, and SVG charts of our own.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#3b6fd8", "#e8773a", "#2f9e5b", "#c23b6b", "#8a5cd1", "#1fa2b8", "#b3962c", "#6b7280", "#999"];

async function api(path, options = {}) {
  const init = {credentials: "same-origin", ...options};
  if (init.body !== undefined && typeof init.body !== "string") {
    init.body = JSON.stringify(init.body);
    init.headers = {"Content-Type": "application/json", ...(init.headers || {})};
  }
  const r = await fetch(path, init);
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    throw new Error((body.error && body.error.message) || ("HTTP " + r.status));
  }
  return body;
}

function el(tag, attrs = {}, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

function fmtTime(t) {
  return t == null ? "–" : new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19);
}

function fmtNum(v, digits = 0) {
  if (v == null) return "–";
  return Number(v).toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
}

function fmtMs(seconds) {
  return seconds == null ? "–" : fmtNum(seconds * 1000, 1);
}

function fmtAxis(v, max) {
  if (v === 0) return "0";
  if (max < 0.01) return v.toPrecision(2);
  return fmtNum(v, max < 10 ? 2 : 0);
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c == null ? "–" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

// A line chart: xs (Unix seconds), series {name: [value or null per x]}. Each series is a
// <g class="series" data-name=.. data-values="v0,v1,.."> holding its polyline.
function lineChart(svg, xs, series, opts = {}) {
  svg.replaceChildren();
  const w = svg.clientWidth || 420, h = svg.clientHeight || 200;
  const pad = {l: 48, r: 8, t: 8, b: 34};
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const names = Object.keys(series);
  let max = 0;
  for (const n of names) for (const v of series[n]) if (v != null && v > max) max = v;
  if (max <= 0) max = 1;
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length > 1 ? xs[xs.length - 1] : x0 + 1;
  const sx = (x) => pad.l + (x - x0) / (x1 - x0 || 1) * (w - pad.l - pad.r);
  const sy = (y) => h - pad.b - y / max * (h - pad.t - pad.b);
  const axis = el("svg:g", {class: "axis"});
  axis.appendChild(el("svg:line", {x1: pad.l, y1: h - pad.b, x2: w - pad.r, y2: h - pad.b, stroke: "#99a"}));
  axis.appendChild(el("svg:line", {x1: pad.l, y1: pad.t, x2: pad.l, y2: h - pad.b, stroke: "#99a"}));
  for (const f of [0, 0.5, 1]) {
    axis.appendChild(el("svg:text", {x: pad.l - 4, y: sy(max * f) + 3, "text-anchor": "end"}, fmtAxis(max * f, max)));
  }
  if (xs.length) {
    for (const x of [x0, x1]) {
      axis.appendChild(el("svg:text", {x: sx(x), y: h - pad.b + 12, "text-anchor": x === x0 ? "start" : "end"},
                          fmtTime(x).slice(5, 16)));
    }
  }
  svg.appendChild(axis);
  const legend = el("svg:g", {class: "legend"});
  let lx = pad.l;
  names.forEach((name, i) => {
    const color = COLORS[i % COLORS.length];
    const values = series[name];
    const g = el("svg:g", {class: "series", "data-name": name, "data-values": values.map((v) => v == null ? "" : v).join(",")});
    let d = "";
    values.forEach((v, j) => {
      if (v == null) return;
      d += `${d && values[j - 1] != null ? "L" : "M"}${sx(xs[j]).toFixed(1)},${sy(v).toFixed(1)}`;
    });
    g.appendChild(el("svg:path", {d, fill: "none", stroke: color, "stroke-width": 1.6}));
    if (xs.length < 80) {
      values.forEach((v, j) => {
        if (v != null && v !== 0) g.appendChild(el("svg:circle", {cx: sx(xs[j]), cy: sy(v), r: 2, fill: color}));
      });
    }
    svg.appendChild(g);
    const label = name.length > 22 ? name.slice(0, 21) + "…" : name;
    const ly = h - 6;
    legend.appendChild(el("svg:rect", {x: lx, y: ly - 8, width: 8, height: 8, fill: color}));
    legend.appendChild(el("svg:text", {x: lx + 11, y: ly}, label));
    lx += 11 + label.length * 6.5 + 14;
  });
  svg.appendChild(legend);
  if (!names.length) svg.appendChild(el("svg:text", {x: w / 2, y: h / 2, "text-anchor": "middle"}, opts.empty || "no data"));
}

document.addEventListener("DOMContentLoaded", () => {
  const out = document.getElementById("logout");
  if (out) {
    out.addEventListener("click", async () => {
      await fetch("/console/logout", {method: "POST", credentials: "same-origin"});
      sessionStorage.removeItem("xlaserve-key");
      location.href = "/console";
    });
  }
});
