// One request's trace as a timeline: queued, prefill (to the first token), decode, finish, and
// every event the gateway noted, from /console/api/requests/{id}.
"use strict";

function kvTable(table, pairs) {
  table.replaceChildren();
  for (const [k, v] of pairs) table.appendChild(row([k, v]));
}

function timeline(svg, t) {
  svg.replaceChildren();
  const w = svg.clientWidth || 800, h = svg.clientHeight || 140, pad = 20;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const t0 = t.created_at;
  const end = Math.max(t.finished_at || t0, ...t.events.map((e) => e.t), t0 + 1e-3);
  const sx = (x) => pad + (x - t0) / (end - t0) * (w - 2 * pad);
  const queued = t.timings.queue_time_s != null ? t0 + t.timings.queue_time_s : null;
  const first = t.first_token_at;
  const segments = [
    ["queued", t0, queued, "#b3962c"],
    ["prefill", queued != null ? queued : t0, first, "#3b6fd8"],
    ["decode", first, t.finished_at, "#2f9e5b"],
  ];
  segments.forEach(([name, a, b, color], i) => {
    if (a == null || b == null || b < a) return;
    const g = el("svg:g", {class: "segment", "data-name": name, "data-ms": ((b - a) * 1000).toFixed(1)});
    g.appendChild(el("svg:rect", {x: sx(a), y: 30, width: Math.max(1, sx(b) - sx(a)), height: 26, fill: color}));
    g.appendChild(el("svg:text", {x: sx(a) + 2, y: i % 2 ? 26 : 14}, `${name} ${((b - a) * 1000).toFixed(1)} ms`));
    svg.appendChild(g);
  });
  t.events.forEach((e, i) => {
    const x = sx(e.t);
    const g = el("svg:g", {class: "event", "data-name": e.event});
    g.appendChild(el("svg:line", {x1: x, y1: 60, x2: x, y2: 76, stroke: "#1d2330"}));
    const anchor = x < pad + 40 ? "start" : x > w - pad - 40 ? "end" : "middle";
    g.appendChild(el("svg:text", {x, y: 88 + (i % 4) * 12, "text-anchor": anchor}, e.event));
    svg.appendChild(g);
  });
  // The replicas it went through: those a router left (and why), then the one(s) that served it.
  const hops = (t.replica_retries || []).map((r) => ({name: r.replica, note: r.reason, left: true}));
  if (t.prefill_replica) hops.push({name: t.prefill_replica, note: "prefill"});
  if (t.decode_replica || t.replica) hops.push({name: t.decode_replica || t.replica, note: t.prefill_replica ? "decode" : "served"});
  let hx = pad;
  hops.forEach((hop, i) => {
    const label = `${i ? "→ " : "replicas: "}${hop.name} (${hop.note})`;
    const g = el("svg:g", {class: "hop", "data-name": hop.name, "data-note": hop.note});
    g.appendChild(el("svg:text", {x: hx, y: h - 18, fill: hop.left ? "#b00020" : "#17803d"}, label));
    svg.appendChild(g);
    hx += label.length * 5.6 + 8;
  });
  svg.appendChild(el("svg:text", {x: pad, y: h - 4}, "0 ms"));
  svg.appendChild(el("svg:text", {x: w - pad, y: h - 4, "text-anchor": "end"}, `${((end - t0) * 1000).toFixed(1)} ms`));
}

async function load() {
  const id = document.getElementById("request-id").dataset.id;
  let t;
  try {
    t = await api("/console/api/requests/" + encodeURIComponent(id));
  } catch (e) {
    document.getElementById("trace-error").textContent = e.message;
    return;
  }
  const summary = document.getElementById("summary");
  summary.replaceChildren();
  for (const [k, v] of [["status", t.status], ["model", t.model], ["tenant", t.tenant], ["finish", t.finish_reason],
                        ["TTFT (ms)", fmtMs(t.timings.ttft_s)], ["total (ms)", fmtMs(t.timings.e2e_s)],
                        ["ITL mean (ms)", fmtMs(t.timings.itl_mean_s)], ["cost (USD)", fmtNum(t.cost_usd, 6)]]) {
    const d = el("div", {"data-field": k});
    d.appendChild(el("span", {}, k));
    d.appendChild(el("b", {}, v == null ? "–" : v));
    summary.appendChild(d);
  }
  const u = t.usage;
  kvTable(document.getElementById("usage"), [
    ["prompt tokens", fmtNum(u.prompt_tokens)], ["cached tokens", fmtNum(u.prompt_tokens_details.cached_tokens)],
    ["host-cached tokens", fmtNum(t.host_cached_tokens)], ["completion tokens", fmtNum(u.completion_tokens)],
    ["reasoning tokens", fmtNum(u.completion_tokens_details.reasoning_tokens)], ["tool calls", fmtNum(t.tool_calls)],
    ["cost (USD)", fmtNum(t.cost_usd, 6)], ["service tier", t.service_tier], ["priority", t.priority],
    ["X-Request-ID", t.x_request_id], ["client retries", t.retries], ["error", t.error],
  ]);
  kvTable(document.getElementById("routing"), [
    ["replica", t.replica], ["prefill replica", t.prefill_replica], ["decode replica", t.decode_replica],
    ["region", t.region], ["replica retries", (t.replica_retries || []).map((r) => JSON.stringify(r)).join("; ") || "none"],
    ["KV transfer", `${fmtNum(t.kv_transfer_bytes)} B in ${fmtMs(t.kv_transfer_seconds)} ms`],
    ["preemptions", t.num_preemptions],
    ["speculative", `${t.speculative.accepted_tokens} of ${t.speculative.draft_tokens} drafts accepted`],
  ]);
  const tbody = document.querySelector("#events tbody");
  tbody.replaceChildren();
  for (const e of t.events) {
    const {t: at, event, ...rest} = e;
    tbody.appendChild(row([fmtNum((at - t.created_at) * 1000, 1), event, JSON.stringify(rest)]));
  }
  timeline(document.getElementById("timeline"), t);
  document.body.dataset.loaded = "1";
}

document.addEventListener("DOMContentLoaded", load);
