// The request list: one page of /console/api/requests at a time, searched by id or filters.
"use strict";

let cursors = [];  // the `after` of each page shown so far

function filters() {
  const q = new URLSearchParams({limit: "50"});
  for (const id of ["q", "status", "tenant", "model", "key_id"]) {
    const v = document.getElementById(id).value.trim();
    if (v) q.set(id, v);
  }
  return q;
}

async function load(after) {
  const q = filters();
  if (after) q.set("after", after);
  const tbody = document.querySelector("#requests tbody");
  let body;
  try {
    body = await api("/console/api/requests?" + q.toString());
  } catch (e) {
    document.getElementById("count").textContent = e.message;
    return;
  }
  tbody.replaceChildren();
  for (const r of body.data) {
    const link = el("a", {href: "/console/requests/" + encodeURIComponent(r.request_id), class: "request-link"}, r.request_id);
    const status = el("span", {class: "status-" + r.status}, r.status);
    tbody.appendChild(row([fmtTime(r.created_at), link, status, r.tenant, r.model, r.service_tier,
                           fmtNum(r.prompt_tokens), fmtNum(r.cached_tokens), fmtNum(r.completion_tokens),
                           fmtNum(r.cost_usd, 6), fmtMs(r.ttft_s), fmtMs(r.e2e_s), r.finish_reason,
                           [r.replica, r.region].filter(Boolean).join(" / ") || "–"]));
  }
  const next = document.getElementById("next");
  next.disabled = !body.has_more;
  next.dataset.after = body.last_id || "";
  document.getElementById("count").textContent = `${body.data.length} rows${body.has_more ? ", more follow" : ""}`;
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("search").addEventListener("submit", (ev) => { ev.preventDefault(); cursors = []; load(); });
  document.getElementById("first").addEventListener("click", () => { cursors = []; load(); });
  document.getElementById("next").addEventListener("click", (ev) => {
    cursors.push(ev.target.dataset.after);
    load(ev.target.dataset.after);
  });
  load();
});
