// Keys, tenants and the audit trail, through /console/api (KeyStore, as `xlaserve keys` does).
"use strict";

function optionalInt(form, name) {
  const v = form.elements[name].value.trim();
  return v === "" ? null : Number(v);
}

function optionalList(form, name) {
  const v = form.elements[name].value.trim();
  return v === "" ? null : v.split(",").map((s) => s.trim()).filter(Boolean);
}

async function loadKeys(after) {
  const q = new URLSearchParams({limit: "50"});
  if (after) q.set("after", after);
  const body = await api("/console/api/keys?" + q.toString());
  const tbody = document.querySelector("#keys tbody");
  if (!after) tbody.replaceChildren();
  for (const k of body.data) {
    let action = "";
    if (k.revoked_at == null) {
      action = el("button", {type: "button", class: "revoke", "data-key-id": k.key_id}, "Revoke");
      action.addEventListener("click", () => revoke(k.key_id));
    }
    const tr = row([k.key_id, k.tenant, k.name, k.key_prefix + "…", k.is_admin ? "yes" : "", k.rpm, k.tpm,
                    k.max_concurrent, k.service_tiers ? k.service_tiers.join(",") : "all", fmtTime(k.created_at),
                    k.revoked_at ? fmtTime(k.revoked_at) : "", action]);
    tr.dataset.keyId = k.key_id;
    tbody.appendChild(tr);
  }
  const more = document.getElementById("keys-next");
  more.disabled = !body.has_more;
  more.dataset.after = body.last_id || "";
}

async function loadTenants() {
  const body = await api("/console/api/tenants");
  const tbody = document.querySelector("#tenants tbody");
  tbody.replaceChildren();
  for (const t of body.data) tbody.appendChild(row([t.name, t.rpm, t.tpm, t.max_concurrent, t.models || "all", t.service_tiers || "all"]));
}

async function loadAudit() {
  const body = await api("/console/api/audit?limit=50");
  const tbody = document.querySelector("#audit tbody");
  tbody.replaceChildren();
  for (const a of body.data) tbody.appendChild(row([fmtTime(a.at), a.actor, a.action, a.target, a.details ? JSON.stringify(a.details) : ""]));
}

async function reload() {
  await Promise.all([loadKeys(), loadTenants(), loadAudit()]);
  document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
}

async function revoke(keyId) {
  try {
    await api(`/console/api/keys/${encodeURIComponent(keyId)}/revoke`, {method: "POST", body: {}});
  } catch (e) {
    document.getElementById("create-error").textContent = e.message;
  }
  await reload();
}

document.addEventListener("DOMContentLoaded", () => {
  const create = document.getElementById("create-key");
  create.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    document.getElementById("create-error").textContent = "";
    try {
      const k = await api("/console/api/keys", {method: "POST", body: {
        tenant: create.elements.tenant.value.trim(), name: create.elements.name.value.trim() || null,
        admin: create.elements.admin.checked, rpm: optionalInt(create, "rpm"), tpm: optionalInt(create, "tpm"),
        max_concurrent: optionalInt(create, "max_concurrent"), service_tiers: optionalList(create, "service_tiers")}});
      document.getElementById("new-key-text").textContent = k.key;
      document.getElementById("new-key-text").dataset.keyId = k.key_id;
      document.getElementById("new-key").hidden = false;
    } catch (e) {
      document.getElementById("create-error").textContent = e.message;
    }
    await reload();
  });
  const tenant = document.getElementById("set-tenant");
  tenant.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    document.getElementById("tenant-error").textContent = "";
    try {
      await api("/console/api/tenants/" + encodeURIComponent(tenant.elements.tenant.value.trim()), {method: "PUT", body: {
        rpm: optionalInt(tenant, "rpm"), tpm: optionalInt(tenant, "tpm"), max_concurrent: optionalInt(tenant, "max_concurrent"),
        models: optionalList(tenant, "models"), service_tiers: optionalList(tenant, "service_tiers")}});
    } catch (e) {
      document.getElementById("tenant-error").textContent = e.message;
    }
    await reload();
  });
  document.getElementById("keys-next").addEventListener("click", (ev) => loadKeys(ev.target.dataset.after));
  reload();
});
