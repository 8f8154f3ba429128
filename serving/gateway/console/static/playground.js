// The playground: a chat request streamed from /v1/chat/completions (SSE read off the response
// body), its usage, and a link to its trace in the console.
"use strict";

function parseEvents(buffer, onData) {
  let i;
  while ((i = buffer.indexOf("\n\n")) >= 0) {
    const block = buffer.slice(0, i);
    buffer = buffer.slice(i + 2);
    for (const line of block.split("\n")) {
      if (line.startsWith("data: ")) onData(line.slice(6));
    }
  }
  return buffer;
}

async function send(ev) {
  ev.preventDefault();
  const key = document.getElementById("api-key").value.trim();
  sessionStorage.setItem("xlaserve-key", key);
  const reply = document.getElementById("reply"), error = document.getElementById("chat-error");
  const toolOut = document.getElementById("tool-calls");
  const link = document.getElementById("trace-link");
  reply.textContent = ""; toolOut.textContent = ""; error.textContent = ""; link.hidden = true;
  document.getElementById("usage").textContent = "–";
  document.getElementById("finish").textContent = "–";
  const messages = [];
  const system = document.getElementById("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push({role: "user", content: document.getElementById("message").value});
  const body = {model: document.getElementById("model").value, messages, stream: true,
                stream_options: {include_usage: true}};
  for (const f of ["max_tokens", "temperature", "top_p", "seed"]) {
    const v = document.getElementById(f).value.trim();
    if (v !== "") body[f] = Number(v);
  }
  const tools = document.getElementById("tools").value.trim();
  if (tools) {
    try { body.tools = JSON.parse(tools); } catch (e) { error.textContent = "tools: " + e.message; return; }
  }
  const headers = {"Content-Type": "application/json"};
  if (key) headers.Authorization = "Bearer " + key;
  document.getElementById("send").disabled = true;
  document.body.dataset.streaming = "1";
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    if (!r.ok) {
      const b = await r.json().catch(() => ({}));
      throw new Error((b.error && b.error.message) || ("HTTP " + r.status));
    }
    const rid = r.headers.get("X-Request-ID");
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", chunks = 0;
    const tools = {};
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer = parseEvents(buffer + decoder.decode(value, {stream: true}), (data) => {
        if (data === "[DONE]") return;
        const c = JSON.parse(data);
        if (c.error) throw new Error(c.error.message);
        for (const choice of c.choices || []) {
          const d = choice.delta || {};
          if (d.content) { reply.textContent += d.content; chunks += 1; reply.dataset.chunks = chunks; }
          for (const tc of d.tool_calls || []) {
            const t = tools[tc.index] = tools[tc.index] || {name: "", arguments: ""};
            if (tc.function && tc.function.name) t.name += tc.function.name;
            if (tc.function && tc.function.arguments) t.arguments += tc.function.arguments;
            toolOut.textContent = Object.values(tools).map((t) => `${t.name}(${t.arguments})`).join("\n");
          }
          if (choice.finish_reason) document.getElementById("finish").textContent = choice.finish_reason;
        }
        if (c.usage) {
          const u = c.usage;
          const cached = (u.prompt_tokens_details || {}).cached_tokens || 0;
          const usage = document.getElementById("usage");
          usage.textContent = `${u.prompt_tokens} in (${cached} cached), ${u.completion_tokens} out, ${u.total_tokens} total`;
          usage.dataset.completionTokens = u.completion_tokens;
          usage.dataset.promptTokens = u.prompt_tokens;
        }
      });
    }
    if (rid) {
      link.href = "/console/requests/" + encodeURIComponent(rid);
      link.hidden = false;
    }
  } catch (e) {
    error.textContent = e.message;
  } finally {
    document.getElementById("send").disabled = false;
    document.body.dataset.streaming = "0";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("api-key").value = sessionStorage.getItem("xlaserve-key") || "";
  document.getElementById("chat").addEventListener("submit", send);
});
