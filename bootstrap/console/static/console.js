// The p2pnode console: reads /console/api/* (JSON and SSE, see docs/console.md) and draws with
// plain SVG. No library and no outside fetch: nodes may run offline.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const state = { self: null, swarm: null, history: [], decisions: [], speculation: null };
const MAX_DECISIONS_SHOWN = 30;

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function svg(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function short(id) {
  if (!id) return "?";
  if (id === "local") return "local";
  return id.length > 12 ? "…" + id.slice(-8) : id;
}
function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}
function ms(seconds) { return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(1); }

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok && r.status !== 503) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

// ------------------------------------------------------------------ swarm

// "member 1.00 (audits 3/0/0, 2 by peers)": state, score, audits passed/failed/skipped here.
function trustText(t) {
  const state = t.state || (t.usable === false ? "demoted" : "");
  const a = t.audits || {};
  const audits = (a.passed || a.failed || a.skipped)
    ? ` (audits ${a.passed || 0}/${a.failed || 0}/${a.skipped || 0}${a.by_peer ? `, ${a.by_peer} by peers` : ""})`
    : "";
  return `${state} ${fmt(t.score, 2)}${audits}`.trim();
}

function renderSwarm(swarm) {
  state.swarm = swarm;
  state.self = swarm.self;
  document.getElementById("node-id").textContent = swarm.self.peer_id || "";
  document.getElementById("node-model").textContent = (swarm.self.models || []).join(", ");
  const tbody = document.querySelector("#peers-table tbody");
  tbody.replaceChildren();
  for (const p of swarm.peers) {
    const tr = el("tr", { "data-peer": p.peer_id });
    const cells = [
      [short(p.peer_id), "mono"], [p.state, "state-" + p.state], [fmt(p.rtt_ms, 1), "num"],
      [p.connection, ""], [(p.roles || []).join(" "), ""], [(p.models || []).map((m) => m.split("@")[0]).join(" "), ""],
      [fmt(p.queue_depth), "num"], [fmt(p.cache_tokens), "num"],
      [p.push_back === null ? "–" : p.push_back ? "yes" : "no", ""],
      [p.trust ? trustText(p.trust) : "–", "num"],
    ];
    for (const [text, cls] of cells) tr.appendChild(el("td", cls ? { class: cls } : {}, text));
    tr.title = p.peer_id + (p.last_error ? `\nlast error: ${p.last_error}` : "");
    tbody.appendChild(tr);
  }
  document.getElementById("peers-empty").style.display = swarm.peers.length ? "none" : "";
  drawGraph(swarm);
}

function drawGraph(swarm) {
  const g = document.getElementById("overlay-graph");
  g.replaceChildren();
  const cx = 210, cy = 150, r = 110;
  const peers = swarm.peers;
  const pos = new Map();
  peers.forEach((p, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, peers.length);
    pos.set(p.peer_id, [cx + r * Math.cos(a), cy + r * Math.sin(a)]);
  });
  const maxCache = Math.max(1, swarm.self.cache_tokens || 0, ...peers.map((p) => p.cache_tokens || 0));
  const radius = (tokens) => 9 + 11 * Math.sqrt((tokens || 0) / maxCache);
  for (const p of peers) {
    const [x, y] = pos.get(p.peer_id);
    const color = p.state === "up" ? "var(--up)" : p.state === "suspect" ? "var(--suspect)" : "var(--down)";
    const line = svg("line", { x1: cx, y1: cy, x2: x, y2: y, stroke: color, "stroke-width": 2 });
    if (p.connection === "relayed") line.setAttribute("stroke-dasharray", "5 4");
    if (p.connection === "hole-punched") line.setAttribute("stroke-dasharray", "1 3");
    const why = p.relayed_because ? ` (${p.relayed_because})` : "";
    line.appendChild(svg("title", {}, `${p.connection}${why}`));
    if (p.connection === "none") line.setAttribute("stroke-opacity", "0.3");
    g.appendChild(line);
    if (p.rtt_ms !== null && p.rtt_ms !== undefined) {
      // At 60% of the way out: clear of this node's own label in the middle.
      const lx = cx + 0.55 * (x - cx) + 4, ly = cy + 0.55 * (y - cy);
      g.appendChild(svg("text", { x: lx, y: ly, "font-size": 10, fill: "#555", "text-anchor": "start" }, `${p.rtt_ms.toFixed(1)} ms`));
    }
  }
  const node = (x, y, rad, fill, label, sub) => {
    g.appendChild(svg("circle", { cx: x, cy: y, r: rad, fill, stroke: "#1d2330", "stroke-width": 1 }));
    // Labels sit on the far side from the centre, clear of the links.
    const d = Math.hypot(x - cx, y - cy);
    const ux = d ? (x - cx) / d : 0, uy = d ? (y - cy) / d : 1;
    const lx = x + ux * (rad + 6);
    const ly = y + uy * (rad + 6) + (uy >= 0 ? 10 : -16);
    const anchor = ux > 0.3 ? "start" : ux < -0.3 ? "end" : "middle";
    g.appendChild(svg("text", { x: lx, y: ly, "font-size": 10, "text-anchor": anchor, "font-family": "monospace" }, label));
    if (sub) g.appendChild(svg("text", { x: lx, y: ly + 11, "font-size": 9, "text-anchor": anchor, fill: "#6b7385" }, sub));
  };
  for (const p of peers) {
    const [x, y] = pos.get(p.peer_id);
    const fill = p.push_back ? "#f3c98b" : (p.models || []).length ? "#cfe0f7" : "#e4e4e4";
    const sub = `${(p.roles || []).join(",")} q${fmt(p.queue_depth)} ${fmt(p.cache_tokens)} tok`;
    node(x, y, radius(p.cache_tokens), fill, short(p.peer_id), sub);
  }
  node(cx, cy, radius(swarm.self.cache_tokens), "#3563c9", "this node", `q${fmt(swarm.self.queue_depth)} ${fmt(swarm.self.cache_tokens)} tok`);
  g.appendChild(svg("text", { x: 6, y: 312, "font-size": 10, fill: "#6b7385" }, "links: RTT measured by this node; dashed = relayed, dotted = hole-punched (hover: why relayed); size = cached tokens"));
}

// ------------------------------------------------------------------ this node

function lineChart(id, points, key, { percent = false } = {}) {
  const g = document.getElementById(id);
  g.replaceChildren();
  const w = g.clientWidth || 240, h = g.clientHeight || 90;
  g.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const data = points.filter((p) => p[key] !== null && p[key] !== undefined);
  if (data.length === 0) {
    g.appendChild(svg("text", { x: 8, y: h / 2, "font-size": 11, fill: "#6b7385" }, "no data yet"));
    return;
  }
  const t0 = data[0].t, t1 = Math.max(data[data.length - 1].t, t0 + 1);
  const vmax = percent ? 1 : Math.max(1e-9, ...data.map((p) => p[key]));
  const X = (t) => 4 + ((w - 8) * (t - t0)) / (t1 - t0);
  const Y = (v) => h - 14 - ((h - 24) * v) / vmax;
  const d = data.map((p, i) => `${i ? "L" : "M"}${X(p.t).toFixed(1)},${Y(p[key]).toFixed(1)}`).join(" ");
  g.appendChild(svg("path", { d, fill: "none", stroke: "var(--accent)", "stroke-width": 1.5 }));
  const last = data[data.length - 1][key];
  const label = percent ? `${(last * 100).toFixed(0)}%` : fmt(last, 1);
  g.appendChild(svg("text", { x: w - 4, y: 12, "font-size": 11, "text-anchor": "end" }, `now ${label}  max ${percent ? "100%" : fmt(vmax, 1)}`));
}

function renderNode() {
  const h = state.history;
  const now = h.length ? h[h.length - 1] : {};
  const stats = document.getElementById("node-stats");
  stats.replaceChildren();
  const items = [
    ["cache tokens", fmt(now.cache_tokens)], ["evicted tokens", fmt(now.evicted_tokens)],
    ["queue", fmt(now.queue_depth)], ["push-back", now.push_back ? "on" : "off"],
    ["tokens/s", fmt(now.tokens_per_s, 1)], ["served for peers", fmt(now.served_for_peers)],
  ];
  if (state.totals) items.push(["hit rate (all time)", state.totals.hit_rate === null ? "–" : `${(state.totals.hit_rate * 100).toFixed(1)}%`]);
  for (const [k, v] of items) { const d = el("div"); d.appendChild(el("b", {}, v)); d.appendChild(document.createTextNode(k)); stats.appendChild(d); }
  lineChart("chart-cache", h, "cache_tokens");
  lineChart("chart-hit", h, "hit_rate", { percent: true });
  lineChart("chart-queue", h, "queue_depth");
  lineChart("chart-tps", h, "tokens_per_s");
}

function addPoint(point) {
  state.history.push(point);
  if (state.history.length > 600) state.history.shift();
}

// ------------------------------------------------------------------ decisions

function decisionCard(d) {
  const card = el("div", { class: "decision", "data-id": d.id });
  const head = el("div", { class: "head" });
  head.appendChild(el("b", {}, d.served_locally ? "served here" : `→ ${short(d.served_by)}`));
  head.appendChild(el("span", { class: "mono" }, d.reason));
  head.appendChild(el("span", { class: "muted" }, `${new Date(d.t * 1000).toLocaleTimeString()} · ${d.prompt_tokens} prompt tok · ${d.generated_tokens} generated · ${d.cached_tokens} cached · ${fmt(d.total_s, 2)} s real`));
  card.appendChild(head);
  card.appendChild(el("div", { class: "why" }, d.why));
  const table = el("table");
  const hr = el("tr");
  for (const c of ["candidate", "network ms", "queue ms", "prefill ms", "prefill saved ms", "decode ms", "total ms", "", "note"]) hr.appendChild(el("th", { class: c.endsWith("ms") ? "num" : "" }, c));
  table.appendChild(hr);
  const maxTotal = Math.max(1e-9, ...d.candidates.map((c) => c.total_s));
  for (const c of d.candidates) {
    const tr = el("tr", c.chosen ? { class: "chosen" } : {});
    tr.appendChild(el("td", { class: "mono" }, c.is_local ? "this node" : short(c.peer_id)));
    for (const v of [c.network_s, c.queue_s, c.prefill_s, c.prefill_saved_s, c.decode_s, c.total_s]) tr.appendChild(el("td", { class: "num" }, ms(v)));
    const bar = el("div", { class: "bar", title: "network | queue | prefill | decode" });
    for (const [k, cls] of [["network_s", "seg-net"], ["queue_s", "seg-queue"], ["prefill_s", "seg-prefill"], ["decode_s", "seg-decode"]]) {
      const s = el("span", { class: cls });
      s.style.width = `${(100 * c[k]) / maxTotal}%`;
      bar.appendChild(s);
    }
    const td = el("td"); td.appendChild(bar); tr.appendChild(td);
    const notes = [];
    if (c.chosen) notes.push("chosen");
    if (c.skipped) notes.push(`skipped: ${c.skipped}`);
    if (!c.is_local) notes.push(`${c.cached_tokens} cached (view ${c.view_cached_tokens}, conf ${fmt(c.confidence, 2)})`);
    else notes.push(`${c.cached_tokens} cached`);
    tr.appendChild(el("td", { class: "muted" }, notes.join("; ")));
    table.appendChild(tr);
  }
  card.appendChild(table);
  if (d.attempts.length > 1) {
    card.appendChild(el("div", { class: "muted" }, "attempts: " + d.attempts.map((a) => `${short(a.target)} ${a.outcome} (${a.tokens} tok, ${fmt(a.seconds, 2)} s)`).join(" → ")));
  }
  return card;
}

function renderDecisions() {
  const box = document.getElementById("decisions");
  box.replaceChildren();
  if (!state.decisions.length) {
    box.appendChild(el("p", { class: "muted", id: "decisions-empty" }, "no routed request yet: send one from the chat below"));
    return;
  }
  const legend = el("div", { class: "legend muted" }, "bars:");
  for (const [cls, name] of [["seg-net", "network"], ["seg-queue", "queue"], ["seg-prefill", "prefill"], ["seg-decode", "decode"]]) {
    legend.appendChild(el("span", { class: cls })); legend.appendChild(document.createTextNode(name));
  }
  box.appendChild(legend);
  for (const d of state.decisions.slice(-MAX_DECISIONS_SHOWN).reverse()) box.appendChild(decisionCard(d));
}

function addDecision(d) {
  if (state.decisions.some((x) => x.seq === d.seq)) return;
  state.decisions.push(d);
  if (state.decisions.length > 200) state.decisions.shift();
  renderDecisions();
}

// ------------------------------------------------------------------ speculation

function renderSpeculation(spec) {
  state.speculation = spec;
  const box = document.getElementById("speculation");
  box.replaceChildren();
  if (!spec.verifier && !spec.edge.length) {
    box.appendChild(el("p", { class: "muted" }, "this node runs no verifier and has seen no edge session"));
    return;
  }
  if (spec.verifier) {
    const v = spec.verifier;
    box.appendChild(el("p", {}, `verifier: acceptance ${v.acceptance === null ? "–" : (v.acceptance * 100).toFixed(1) + "%"}, ${v.lead_tokens} lead tokens, ${v.stats.blocks || 0} blocks in ${v.stats.batches || 0} batches, ${v.sessions.length}/${v.max_sessions} sessions`));
    const t = el("table");
    const hr = el("tr");
    for (const c of ["session", "committed", "blocks", "acceptance", "lead tokens", "lead left", "tokens/s"]) hr.appendChild(el("th", {}, c));
    t.appendChild(hr);
    for (const s of v.sessions) {
      const tr = el("tr");
      const acc = s.acceptance === null || s.acceptance === undefined ? "–" : `${(s.acceptance * 100).toFixed(1)}%`;
      for (const x of [s.sid.slice(0, 10), s.committed_tokens, fmt(s.blocks), acc, fmt(s.lead_tokens), s.lead_left, fmt(s.tokens_per_s, 1)]) tr.appendChild(el("td", {}, x));
      t.appendChild(tr);
    }
    box.appendChild(t);
  }
  if (spec.edge.length) {
    box.appendChild(el("p", {}, "edge sessions"));
    const t = el("table");
    const hr = el("tr");
    for (const c of ["time", "mode", "tokens", "acceptance", "lead tokens", "tokens/s", "verifiers"]) hr.appendChild(el("th", {}, c));
    t.appendChild(hr);
    for (const e of spec.edge.slice().reverse()) {
      const tr = el("tr");
      for (const x of [new Date(e.t * 1000).toLocaleTimeString(), e.mode, e.tokens, `${(e.acceptance * 100).toFixed(1)}%`, e.lead_tokens, fmt(e.tokens_per_s, 1), e.verifiers.map(short).join(" ")]) tr.appendChild(el("td", {}, x));
      t.appendChild(tr);
    }
    box.appendChild(t);
  }
}

// ------------------------------------------------------------------ health and events

async function refreshHealth() {
  const badge = document.getElementById("health");
  try {
    const h = await getJSON("/health");
    badge.textContent = h.ready ? "ready" : `${h.status}: model ${h.model}, overlay ${h.overlay}`;
    badge.className = "badge " + (h.ready ? "ok" : "bad");
  } catch (err) {
    badge.textContent = "unreachable";
    badge.className = "badge bad";
  }
}

function connectEvents() {
  const badge = document.getElementById("stream-state");
  const es = new EventSource("/console/api/events");
  es.onopen = () => { badge.textContent = "live"; badge.className = "badge ok"; };
  es.onerror = () => { badge.textContent = "reconnecting"; badge.className = "badge bad"; };
  es.addEventListener("swarm", (e) => renderSwarm(JSON.parse(e.data)));
  es.addEventListener("node", (e) => { addPoint(JSON.parse(e.data)); renderNode(); });
  es.addEventListener("decision", (e) => addDecision(JSON.parse(e.data)));
  es.addEventListener("speculation", (e) => renderSpeculation(JSON.parse(e.data)));
}

// ------------------------------------------------------------------ chat

const chat = [];

function chatMessage(role, text) {
  const div = el("div", { class: `msg ${role}` });
  const body = el("span", { class: "text" }, text);
  div.appendChild(body);
  document.getElementById("chat-log").appendChild(div);
  return { div, body };
}

async function sendChat(ev) {
  ev.preventDefault();
  const input = document.getElementById("chat-input");
  const button = document.getElementById("chat-send");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  button.disabled = true;
  chat.push({ role: "user", content: text });
  chatMessage("user", text);
  const answer = chatMessage("assistant", "");
  answer.div.classList.add("streaming");
  let content = "";
  let info = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ messages: chat, stream: true, temperature: 0, max_tokens: Number(document.getElementById("chat-max").value) || 48 }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          for (const c of chunk.choices || []) {
            if (c.delta && c.delta.content) { content += c.delta.content; answer.body.textContent = content; }
          }
          if (chunk.p2pnode) info = chunk.p2pnode;
        }
      }
      const log = document.getElementById("chat-log");
      log.scrollTop = log.scrollHeight;
    }
    chat.push({ role: "assistant", content });
    if (info) {
      const where = info.served_locally ? "this node" : short(info.served_by);
      answer.div.appendChild(el("span", { class: "meta" }, `served by ${where} · ${info.cached_tokens ?? 0} cached prompt tokens · ${fmt(info.total_s, 2)} s`));
    }
  } catch (err) {
    answer.div.className = "msg error";
    answer.body.textContent = `error: ${err.message}`;
    chat.pop();
  } finally {
    answer.div.classList.remove("streaming");
    answer.div.classList.add("done");
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ start

async function start() {
  document.getElementById("chat-form").addEventListener("submit", sendChat);
  document.getElementById("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); document.getElementById("chat-form").requestSubmit(); }
  });
  try {
    const snap = await getJSON("/console/api/snapshot");
    renderSwarm(snap.swarm);
    state.history = snap.node.history.slice();
    state.totals = snap.node;
    renderNode();
    for (const d of snap.decisions) state.decisions.push(d);
    renderDecisions();
    renderSpeculation(snap.speculation);
  } catch (err) {
    document.getElementById("health").textContent = `console data unavailable: ${err.message}`;
  }
  refreshHealth();
  setInterval(refreshHealth, 5000);
  setInterval(async () => {
    try {
      state.totals = await getJSON("/console/api/node");
      state.history = state.totals.history.slice();  // this poll may have taken the latest point
      renderNode();
    } catch (err) { /* the health badge shows an unreachable node */ }
  }, 5000);
  connectEvents();
}

start();
