// The overview: usage series and latency percentiles from /console/api/overview, the engines'
// queue depth and KV-cache use sampled at each refresh.
"use strict";

const METRICS = ["requests", "prompt_tokens", "completion_tokens", "cost_usd", "errors"];
const engineSamples = [];  // [{t, data: {model: snapshot}}], the last 120
let timer = null;

function params() {
  const q = new URLSearchParams({
    step: document.getElementById("step").value,
    buckets: document.getElementById("buckets").value || "60",
    by: document.getElementById("by").value,
  });
  return q.toString();
}

function toMs(values) {
  return values.map((v) => v == null ? null : v * 1000);
}

async function refresh() {
  let body;
  try {
    body = await api("/console/api/overview?" + params());
  } catch (e) {
    document.getElementById("window").textContent = e.message;
    return;
  }
  document.getElementById("window").textContent =
    `${fmtTime(body.start)} – ${fmtTime(body.end)} UTC, ${body.latency.samples} latency samples, read ${fmtTime(body.computed_at).slice(11)}`;
  for (const m of METRICS) {
    const v = body.totals[m];
    const node = document.getElementById("total-" + m);
    node.textContent = m === "cost_usd" ? fmtNum(v, 6) : fmtNum(v);
    node.dataset.value = v;
    lineChart(document.getElementById("chart-" + m), body.buckets, body.series[m]);
  }
  const lat = body.latency;
  lineChart(document.getElementById("chart-ttft"), body.buckets,
            {p50: toMs(lat.ttft_p50), p90: toMs(lat.ttft_p90), p99: toMs(lat.ttft_p99)});
  lineChart(document.getElementById("chart-itl"), body.buckets,
            {p50: toMs(lat.itl_p50), p90: toMs(lat.itl_p90), p99: toMs(lat.itl_p99)});
  engineSamples.push({t: Date.now() / 1000, data: body.engines});
  if (engineSamples.length > 120) engineSamples.shift();
  const ts = engineSamples.map((s) => s.t);
  const queue = {}, kv = {};
  for (const name of Object.keys(body.engines)) {
    const pick = (f, scale = 1) => engineSamples.map((s) => s.data[name] && s.data[name][f] != null ? s.data[name][f] * scale : null);
    queue[name + " waiting"] = pick("num_waiting");
    queue[name + " running"] = pick("num_running");
    kv[name] = pick("kv_cache_usage", 100);
  }
  lineChart(document.getElementById("chart-queue"), ts, queue, {empty: "no engine stats"});
  lineChart(document.getElementById("chart-kv"), ts, kv, {empty: "no engine stats"});
  document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
}

function schedule() {
  clearInterval(timer);
  if (document.getElementById("live").checked) timer = setInterval(refresh, 5000);
}

document.addEventListener("DOMContentLoaded", () => {
  for (const id of ["step", "buckets", "by"]) document.getElementById(id).addEventListener("change", refresh);
  document.getElementById("live").addEventListener("change", schedule);
  document.getElementById("controls").addEventListener("submit", (ev) => { ev.preventDefault(); refresh(); });
  refresh();
  schedule();
});
