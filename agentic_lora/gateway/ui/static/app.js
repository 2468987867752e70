// The agentic-lora status page: polls api/view about once a second and redraws what changed.
// Every node is built with createElement and text: no value from the server is ever parsed as markup.
"use strict";

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;
const MAX_BACKOFF_MS = 5000;
const VERSIONS_PAGE = 25;
const LEASES_PAGE = 10;

const state = {
  etag: null,
  view: null,
  skew: 0, // server time minus this browser's, from the last full answer
  versionsOffset: 0,
  leasesOffset: 0,
  allVersions: false,
  timer: null,
  failures: 0,
  loggedIn: false,
  opened: new Map(), // operation seq -> whether its details are open (the user's choice)
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function fill(tbody, rows, empty, columns) {
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "muted", colspan: columns }, empty))]));
}

function seconds(s) {
  if (s === null || s === undefined) return "…";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  return `${Math.round(s / 60)} min`;
}

function serverNow() {
  return Date.now() / 1000 + state.skew;
}

function ago(at) {
  return `${seconds(Math.max(0, serverNow() - at))} ago`;
}

function clock(at) {
  return new Date(at * 1000).toLocaleTimeString();
}

// --- polling -------------------------------------------------------------------------------

function query() {
  const params = new URLSearchParams({
    versions_offset: state.versionsOffset,
    versions_limit: VERSIONS_PAGE,
    all_versions: state.allVersions ? "1" : "0",
    leases_offset: state.leasesOffset,
    leases_limit: LEASES_PAGE,
  });
  return `api/view?${params}`;
}

function schedule(ms) {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, ms);
}

async function poll() {
  const headers = state.etag ? { "If-None-Match": state.etag } : {};
  let response;
  try {
    response = await fetch(query(), { headers, cache: "no-store", credentials: "same-origin" });
  } catch (error) {
    return offline();
  }
  if (response.status === 401) return showLogin("");
  if (response.status === 200) {
    state.etag = response.headers.get("ETag");
    state.view = await response.json();
    state.skew = state.view.at - Date.now() / 1000;
    render(state.view);
  } else if (response.status !== 304) {
    return offline(`the gateway answered ${response.status}`);
  }
  state.failures = 0;
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  $("updated").classList.remove("error");
  if (state.view) renderTimes();
  schedule(document.hidden ? HIDDEN_POLL_MS : POLL_MS);
}

function offline(message) {
  state.failures += 1;
  $("updated").textContent = message || "the gateway does not answer; retrying";
  $("updated").classList.add("error");
  schedule(Math.min(MAX_BACKOFF_MS, POLL_MS * 2 ** state.failures));
}

function refresh() {
  state.etag = null;
  schedule(0);
}

// --- login ---------------------------------------------------------------------------------

function showLogin(message) {
  clearTimeout(state.timer);
  state.loggedIn = false;
  state.etag = null;
  $("dashboard").hidden = true;
  $("logout").hidden = true;
  $("login-panel").hidden = false;
  $("login-error").textContent = message;
  $("readiness").textContent = "logged out";
  $("readiness").className = "pill";
  $("token").focus();
}

function showDashboard() {
  state.loggedIn = true;
  $("login-panel").hidden = true;
  $("dashboard").hidden = false;
  $("logout").hidden = false;
  refresh();
}

async function post(path, body) {
  return fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    cache: "no-store",
    credentials: "same-origin",
  });
}

async function login(event) {
  event.preventDefault();
  const input = $("token");
  let response;
  try {
    response = await post("login", { token: input.value });
  } catch (error) {
    $("login-error").textContent = "the gateway does not answer";
    return;
  }
  input.value = "";
  if (response.ok) return showDashboard();
  let reason = "";
  try {
    reason = (await response.json()).error.details.reason;
  } catch (error) {
    reason = "";
  }
  const messages = {
    bad_admin_token: "Wrong admin token.",
    admin_disabled: "The gateway runs without an admin token: the status page is disabled.",
    too_many_attempts: `Too many failed logins; try again in ${response.headers.get("Retry-After") || "a few"} s.`,
  };
  $("login-error").textContent = messages[reason] || `Refused (${response.status}).`;
}

async function logout() {
  try {
    await post("logout", {});
  } finally {
    showLogin("Logged out.");
  }
}

// --- rendering -----------------------------------------------------------------------------

function render(view) {
  renderSummary(view.summary);
  renderVersions(view.versions);
  renderEngines(view.engines);
  renderTimeline(view.timeline);
  renderStaleness(view.staleness);
  renderRefusals(view.refusals);
  renderLeases(view.leases);
}

function renderTimes() {
  for (const node of document.querySelectorAll("[data-expires-at]")) {
    node.textContent = seconds(Math.max(0, Number(node.dataset.expiresAt) - serverNow()));
  }
  for (const node of document.querySelectorAll("[data-ago]")) {
    node.textContent = ago(Number(node.dataset.ago));
  }
}

function card(label, value, testid, detail) {
  return el("div", { class: "card" },
    el("div", { class: "label" }, label),
    el("div", { class: "value", "data-testid": testid }, value),
    detail ? el("div", { class: "muted" }, detail) : null);
}

function renderSummary(s) {
  const pill = $("readiness");
  pill.textContent = s.ready ? "ready" : `not ready: ${s.reasons.join(", ")}`;
  pill.className = s.ready ? "pill ok" : "pill bad";
  $("summary").replaceChildren(
    card("default version", s.default_version ?? "none", "default-version",
      `revision ${s.default_revision}` +
        (s.rolled_back_from ? `, rolled back from ${s.rolled_back_from}` : "")),
    card("publishing", s.pending_version ?? "nothing", "pending-version", null),
    card("capacity", `${s.slots_in_use} / ${s.capacity}`, "capacity", "slots in use"),
    card("Sessions", String(s.registry_sessions), "registry-sessions",
      `${s.gateway_sessions} open in this gateway, ${s.adopted_sessions} adopted`),
    card("epoch", String(s.deployment_epoch), "epoch", `${s.named_sessions} named Sessions`),
  );
}

function pager(node, page, onMove) {
  const first = page.total === 0 ? 0 : page.offset + 1;
  const last = Math.min(page.offset + page.limit, page.total);
  const prev = el("button", { type: "button", disabled: page.offset === 0 }, "‹ newer");
  const next = el("button", { type: "button", disabled: last >= page.total }, "older ›");
  prev.addEventListener("click", () => onMove(Math.max(0, page.offset - page.limit)));
  next.addEventListener("click", () => onMove(page.offset + page.limit));
  node.replaceChildren(prev, ` ${first}–${last} of ${page.total} `, next);
}

function renderVersions(v) {
  const counts = Object.entries(v.by_state).filter(([, n]) => n > 0).map(([s, n]) => `${n} ${s.toLowerCase()}`);
  $("version-counts").textContent = counts.length ? `(${counts.join(", ")})` : "(none yet)";
  const rows = v.rows.map((r) => el("tr", { class: r.default ? "default" : null, dataset: { version: r.version_id } },
    el("td", {}, r.version_id, r.default ? el("span", { class: "badge", "data-testid": "default-badge" }, "default") : null),
    el("td", { dataset: { col: "state" } }, el("span", { class: `state ${r.state.toLowerCase()}` }, r.state)),
    el("td", { class: "mono", title: r.lora_name }, r.digest),
    el("td", { class: "num", dataset: { col: "sessions" } }, String(r.sessions)),
    el("td", { class: "num", dataset: { col: "lag" } }, r.lag === null ? "–" : String(r.lag)),
    el("td", {}, r.ready_engines.join(" ") || "–")));
  fill($("versions").tBodies[0], rows, "no version matches", 6);
  pager($("versions-pager"), { offset: v.offset, limit: v.limit, total: v.matching }, (offset) => {
    state.versionsOffset = offset;
    refresh();
  });
}

function renderEngines(engines) {
  const rows = engines.map((e) => {
    const health = e.healthy === null || e.healthy === undefined ? "unknown" : e.healthy ? "healthy" : "unhealthy";
    // Membership and whatever else the registry reports per engine: empty values left out,
    // lists (what a member owes) as their length.
    const extra = Object.entries(e.extra || {})
      .filter(([, x]) => x !== null && !(Array.isArray(x) && x.length === 0))
      .map(([k, x]) => `${k}: ${Array.isArray(x) ? x.length : typeof x === "object" ? JSON.stringify(x) : x}`);
    return el("tr", { dataset: { engine: e.engine } },
      el("td", {}, e.engine),
      el("td", { dataset: { col: "health" } }, el("span", { class: `health ${health}` }, health)),
      el("td", { class: "mono" }, e.incarnation ?? "–"),
      el("td", { class: "num" }, String(e.slots_used)),
      el("td", {}, e.adapters.map((a) => `${a.version_id} (${a.state.toLowerCase()})`).join(", ") || "–"),
      el("td", { dataset: { col: "membership" } }, [e.membership, ...extra].filter(Boolean).join("; ") || "–"));
  });
  fill($("engines").tBodies[0], rows, "no engine", 6);
}

function renderTimeline(ops) {
  const blocks = ops.map((op) => {
    const end = Math.max(op.updated_at, ...op.steps.map((s) => s.at + (s.seconds ?? 0)));
    const span = Math.max(end - op.started_at, 0.001);
    const outcome = op.outcome ?? "running";
    const bars = op.steps.map((s) => {
      const bar = el("span", { class: `bar ${s.status.toLowerCase()}` });
      // CSSOM, not a style attribute: allowed by the page's Content-Security-Policy.
      bar.style.marginLeft = `${(100 * (s.at - op.started_at)) / span}%`;
      bar.style.width = `${Math.max(0.5, (100 * (s.seconds ?? Math.max(0, serverNow() - s.at))) / span)}%`;
      return el("div", { class: "step" },
        el("span", { class: "who" }, s.engine ?? "fleet"),
        el("span", { class: "what" }, s.phase),
        el("span", { class: "track" }, bar),
        el("span", { class: "took" }, s.status === "STARTED" ? "running" : seconds(s.seconds), s.error_code ? ` ${s.error_code}` : ""));
    });
    const open = state.opened.has(op.seq) ? state.opened.get(op.seq) : op === ops[0];
    const summary = el("summary", {},
      el("span", { class: `outcome ${outcome}`, "data-testid": "outcome" }, outcome),
      ` ${op.kind} ${op.version_id} · started ${clock(op.started_at)} · ${seconds(end - op.started_at)}`,
      op.error_code ? el("span", { class: "error" }, ` ${op.error_code}`) : null,
      op.dropped ? el("span", { class: "muted" }, ` (${op.dropped} events not kept)`) : null,
      op.steps.length < op.step_count ? el("span", { class: "muted" }, ` (${op.step_count} steps)`) : null);
    const block = el("details", { class: "operation", open, dataset: { version: op.version_id, kind: op.kind } }, summary, bars);
    // Only a click is the user's choice (the toggle event also fires for the initial state).
    summary.addEventListener("click", () => state.opened.set(op.seq, !block.open));
    return block;
  });
  $("timeline").replaceChildren(...(blocks.length ? blocks : [el("p", { class: "muted" }, "nothing published or reclaimed since the gateway started")]));
}

function barRows(node, entries, empty) {
  const top = Math.max(1, ...entries.map(([, n]) => n));
  const rows = entries.map(([label, n]) => {
    const bar = el("span", { class: "bar done" });
    bar.style.width = `${(100 * n) / top}%`;
    return el("div", { class: "step", dataset: { lag: label } },
      el("span", { class: "who" }, label),
      el("span", { class: "track" }, bar),
      el("span", { class: "took num" }, String(n)));
  });
  node.replaceChildren(...(rows.length ? rows : [el("p", { class: "muted" }, empty)]));
}

function renderStaleness(s) {
  barRows($("lag-sessions"), s.sessions_by_lag.map(([lag, n]) => [`lag ${lag}`, n]), "no bound Session");
  if (!s.dispatches) {
    barRows($("lag-dispatches"), [], "metrics are off on this gateway");
    return;
  }
  // Prometheus buckets are cumulative: show each bucket's own count.
  let below = 0;
  const own = [];
  for (const [le, cumulative] of s.dispatches.buckets) {
    own.push([le === "+Inf" ? "> last" : `≤ ${Number(le)}`, cumulative - below]);
    below = cumulative;
  }
  barRows($("lag-dispatches"), s.dispatches.count ? own : [], "no dispatch yet");
}

function renderRefusals(r) {
  $("refusal-total").textContent = `(${r.total} since start)`;
  const rows = Object.entries(r.by_code).map(([code, n]) =>
    el("tr", { dataset: { code } }, el("td", { class: "mono" }, code), el("td", { class: "num" }, String(n))));
  fill($("refusal-codes").tBodies[0], rows, "none", 2);
  $("refusal-recent").replaceChildren(...r.recent.map((x) =>
    el("li", {}, el("span", { class: "mono" }, x.code), ` ${x.outcome} on ${x.route} · `, el("span", { dataset: { ago: x.at } }, ago(x.at)))));
}

function renderLeases(l) {
  $("lease-counts").textContent = `(${l.total} live, holding ${l.sessions} Sessions)`;
  const rows = l.rows.map((x) => el("tr", { dataset: { owner: x.owner } },
    el("td", {}, x.owner),
    el("td", { class: "mono" }, x.incarnation),
    el("td", { class: "num" }, String(x.sessions)),
    el("td", { class: "num" }, String(x.names)),
    el("td", { class: "num", dataset: { expiresAt: x.expires_at } }, seconds(Math.max(0, x.expires_at - serverNow())))));
  fill($("leases").tBodies[0], rows, "no live lease", 5);
  pager($("leases-pager"), l, (offset) => {
    state.leasesOffset = offset;
    refresh();
  });
}

// --- start ---------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("all-versions").addEventListener("change", (event) => {
    state.allVersions = event.target.checked;
    state.versionsOffset = 0;
    refresh();
  });
  document.addEventListener("visibilitychange", () => {
    if (state.loggedIn && !document.hidden) schedule(0);
  });
  // Logged in already (a live cookie)? The first poll says; a 401 shows the login form.
  $("dashboard").hidden = false;
  state.loggedIn = true;
  poll();
});
