// pagoda's browser view: the playground (streams chat and completions with the API's sampling
// fields; embeddings on a --runner pooling server), the live engine view fed by GET /v1/engine/events (server-sent events read with
// fetch, so the API key goes in a header), and a request's explanation
// (GET /v1/requests/{id}/explain). Behind Ray Serve, the x-pagoda-replica header pins the feed
// and the explanation to one replica (GET /v1/replicas lists them).
"use strict";

const { LinePlot, formatSeconds, formatNumber, formatPercent } = window.PagodaPlots;
const $ = (id) => document.getElementById(id);
const FREE = 0, CACHED = 1;
const MAX_QUEUE_ROWS = 40;

// How often the engine view updates (the feed's interval_s): ?refresh= in the page's address,
// else the last choice, else once a second (cheap for the machine it watches).
const REFRESH_CHOICES = ["0.2", "1", "5"];
function initialRefresh() {
  const asked = new URLSearchParams(window.location.search).get("refresh") || localStorage.getItem("pagoda.refresh");
  return REFRESH_CHOICES.includes(asked) ? asked : "1";
}

const state = {
  key: localStorage.getItem("pagoda.apiKey") || "",
  refresh: initialRefresh(),
  replica: "",
  model: null,
  history: [],          // the chat so far: [{role, content}]
  last: null,           // the last request: {id, replica}
  abort: null,          // the playground's AbortController while a request streams
  feedAbort: null,
  rates: [],            // [time, prompt tokens total, generation tokens total]
  snapshot: null,       // the latest engine snapshot
};

// ---- the API ---------------------------------------------------------------------------------
function headers(json, replica) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  if (state.key) h["authorization"] = "Bearer " + state.key;
  const pinned = replica === undefined ? state.replica : replica;
  if (pinned) h["x-pagoda-replica"] = pinned;
  return h;
}

async function failure(response) {
  let message = response.status + " " + response.statusText;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = response.status + ": " + body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  return new Error(message);
}

async function getJSON(path, replica) {
  const r = await fetch(path, { headers: headers(false, replica) });
  if (!r.ok) throw await failure(r);
  return r.json();
}

// The `data:` payloads of a server-sent-events response, as they arrive.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ---- the header: model, replicas, key ------------------------------------------------------------
// The model's name; whether the server is pagoda's Ray Serve app (its responses name a replica).
async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers(false, "") });
    if (!r.ok) throw await failure(r);
    state.model = (await r.json()).data[0].id;
    $("model").textContent = state.model;
    return r.headers.has("x-pagoda-replica");
  } catch (e) {
    $("model").textContent = "models: " + e.message;
    return false;
  }
}

async function loadReplicas(behindRay) {
  const select = $("replica");
  select.parentElement.hidden = !behindRay; // one server: nothing to pick
  if (!behindRay) return;
  try {
    const listed = await getJSON("/v1/replicas", "");
    select.replaceChildren(...listed.replicas.map((id) => {
      const option = document.createElement("option");
      option.value = option.textContent = id;
      return option;
    }));
    state.replica = select.value;
  } catch (e) {
    setFeedState("replicas: " + e.message, "down");
  }
}

function setFeedState(text, cls) {
  const pill = $("feed-state");
  pill.textContent = text;
  pill.className = "pill " + (cls || "");
}

// ---- the live feed -------------------------------------------------------------------------------
async function runFeed() {
  for (;;) {
    const abort = new AbortController();
    state.feedAbort = abort;
    try {
      const r = await fetch(`/v1/engine/events?interval_s=${state.refresh}`, { headers: headers(false), signal: abort.signal });
      if (!r.ok) {
        const e = await failure(r);
        setFeedState(r.status === 401 ? "API key needed" : e.message, "down");
      } else {
        const replica = r.headers.get("x-pagoda-replica");
        $("feed-state").dataset.replica = replica || "";
        setFeedState(replica ? "live: replica " + replica : "live", "live");
        for await (const data of events(r)) render(JSON.parse(data));
        setFeedState("feed ended", "down");
      }
    } catch (e) {
      if (!abort.signal.aborted) setFeedState("feed lost: " + e.message, "down");
    }
    await sleep(1000);
  }
}

function restartFeed() {
  state.rates = [];
  if (state.feedAbort) state.feedAbort.abort();
}

// The block pool follows every event; the numbers, the queue table and the plots (two minutes
// wide; they take every sample) are redrawn at most once a second, which keeps the page cheap
// for the machine it watches when both share one host (benchmarks/live_view_windows.py).
const SLOW_REDRAW_S = 1.0;
let slowDrawn = 0;

function render(event) {
  const engine = event.engine, numbers = event.metrics;
  state.snapshot = engine;
  const slow = !document.hidden && Math.abs(engine.time - slowDrawn) >= SLOW_REDRAW_S;
  if (slow) slowDrawn = engine.time;
  pushPlots(engine, numbers, slow);
  if (document.hidden) return; // nothing to draw for: the plots keep their samples
  drawPool(engine);
  if (!slow) return;
  renderStats(engine);
  renderQueues(engine);
}

// The stat boxes, built once: [value, label, bar fill or null] elements by key
const statBoxes = {};

function stat(key, value, label, fraction) {
  let box = statBoxes[key];
  if (!box) {
    const div = document.createElement("div");
    div.className = "stat";
    div.dataset.stat = key;
    div.innerHTML = "<b></b><span></span>" + (fraction === undefined ? "" : '<div class="bar"><i></i></div>');
    $("stats").append(div);
    box = statBoxes[key] = [div.querySelector("b"), div.querySelector("span"), div.querySelector("i")];
  }
  setText(box[0], String(value));
  setText(box[1], label);
  if (box[2]) {
    const width = Math.min(100, fraction * 100).toFixed(1) + "%";
    if (box[2].style.width !== width) box[2].style.width = width;
  }
}

function renderStats(engine) {
  const queues = { running: 0, waiting: 0, preempted: 0 };
  for (const r of engine.requests) queues[r.queue] += 1;
  const { held, cached } = pool.counts; // drawPool counted them for this snapshot
  const n = engine.block_state.length;
  const hitRate = engine.prefix_cache_queries ? engine.prefix_cache_hits / engine.prefix_cache_queries : 0;
  const budget = engine.num_scheduled_tokens / engine.max_num_batched_tokens;
  stat("running", queues.running, "running");
  stat("waiting", queues.waiting + queues.preempted, `waiting (${queues.preempted} preempted)`);
  stat("preemptions", engine.num_preemptions, "preemptions");
  stat("budget", `${engine.num_scheduled_tokens} / ${engine.max_num_batched_tokens}`, "token budget, last step", budget);
  stat("blocks", `${held} / ${n}`, "KV blocks in use", held / n);
  stat("cached", cached, "cached, evictable");
  stat("hits", formatPercent(hitRate), "prefix cache hits", hitRate);
  stat("step", engine.step_id, "step");
}

// Writes only what changed: every write makes the browser lay out and paint again.
function setText(element, text) {
  if (element.textContent !== text) element.textContent = text;
}

function setData(element, values) {
  for (const [k, v] of Object.entries(values)) if (element.dataset[k] !== String(v)) element.dataset[k] = v;
}

// hue of a request, stable across snapshots
function hue(requestId) {
  let h = 2166136261; // FNV-1a
  for (let i = 0; i < requestId.length; i++) h = Math.imul(h ^ requestId.charCodeAt(i), 16777619) >>> 0;
  return h % 360;
}

function poolGeometry(canvas, count) {
  const width = canvas.clientWidth || 640;
  const cell = Math.max(3, Math.min(16, Math.floor(Math.sqrt((width * 220) / Math.max(count, 1)))));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(count / cols), width };
}

// The colour of each block last drawn ("" before any), so a snapshot repaints only the cells
// that changed: the page stays cheap on the machine it watches.
const pool = { key: "", painted: [], colours: new Map(), counts: { held: 0, cached: 0 } };

function blockColour(engine, b) {
  const s = engine.block_state[b], owner = engine.block_owner[b];
  let colour = s === FREE ? "#2a2f38" : s === CACHED ? "#5d6b7d" : "#b0b6c0";
  if (s > CACHED && owner >= 0) {
    const id = engine.requests[owner].request_id;
    colour = pool.colours.get(id);
    if (colour === undefined) {
      colour = `hsl(${hue(id)} 65% 55%)`;
      if (pool.colours.size > 4096) pool.colours.clear();
      pool.colours.set(id, colour);
    }
  }
  return engine.block_ref_cnt[b] > 1 ? colour + "|shared" : colour;
}

function drawPool(engine) {
  const canvas = $("pool");
  const n = engine.block_state.length;
  const { cell, cols, rows, width } = poolGeometry(canvas, n);
  const ratio = window.devicePixelRatio || 1;
  const g = canvas.getContext("2d");
  const key = [n, cell, cols, width, ratio].join(",");
  if (key !== pool.key) { // a new size: resize (which clears) and paint every cell
    canvas.style.height = rows * cell + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(rows * cell * ratio);
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    pool.key = key;
    pool.painted = new Array(n).fill("");
  }
  const gap = cell > 5 ? 1 : 0;
  const owners = new Set();
  let held = 0, cached = 0, shared = 0;
  for (let b = 0; b < n; b++) {
    const s = engine.block_state[b];
    if (s === CACHED) cached += 1;
    if (s > CACHED) { held += 1; if (engine.block_owner[b] >= 0) owners.add(engine.block_owner[b]); }
    if (engine.block_ref_cnt[b] > 1) shared += 1;
    const colour = blockColour(engine, b);
    if (colour === pool.painted[b]) continue;
    pool.painted[b] = colour;
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    const [fill, outline] = colour.split("|");
    g.fillStyle = fill;
    g.fillRect(x, y, cell - gap, cell - gap);
    if (outline && cell >= 5) {
      g.strokeStyle = "#ffffff";
      g.lineWidth = 1;
      g.strokeRect(x + 1.5, y + 1.5, cell - gap - 3, cell - gap - 3);
    }
  }
  pool.counts = { held, cached };
  // what the canvas shows, for the page's tests
  setData(canvas, { blocks: n, held, shared, owners: owners.size });
  setText($("pool-caption"), `${n} blocks of ${engine.block_size} tokens`);
}

function poolTip(e) {
  const engine = state.snapshot, tip = $("pool-tip"), canvas = $("pool");
  if (!engine) return;
  const box = canvas.getBoundingClientRect();
  const { cell, cols } = poolGeometry(canvas, engine.block_state.length);
  const col = Math.floor((e.clientX - box.left) / cell), row = Math.floor((e.clientY - box.top) / cell);
  const b = row * cols + col;
  if (col >= cols || b < 0 || b >= engine.block_state.length) { tip.hidden = true; return; }
  const names = ["free", "cached, evictable", "in use"];
  const owner = engine.block_owner[b] >= 0 ? engine.requests[engine.block_owner[b]].request_id : "none";
  tip.textContent = `block ${b}: ${names[engine.block_state[b]]}, ref count ${engine.block_ref_cnt[b]}, owner ${owner}`;
  tip.style.left = Math.min(e.clientX - box.left + 12, box.width - 260) + "px";
  tip.style.top = e.clientY - box.top + 12 + "px";
  tip.hidden = false;
}

// One table row per queued request (the first MAX_QUEUE_ROWS), reused from snapshot to snapshot.
function queueRow() {
  const tr = document.createElement("tr");
  tr.innerHTML = '<td class="id"></td><td></td><td><span class="bar"><i></i></span><span></span></td><td></td><td></td><td></td><td></td>';
  return tr;
}

function renderQueues(engine) {
  const body = $("queues").tBodies[0];
  const shown = engine.requests.slice(0, MAX_QUEUE_ROWS);
  while (body.rows.length > shown.length) body.deleteRow(-1);
  while (body.rows.length < shown.length) body.append(queueRow());
  shown.forEach((r, i) => {
    const tr = body.rows[i], cells = tr.cells;
    setData(tr, { queue: r.queue });
    if (cells[0].title !== r.request_id) {
      cells[0].title = cells[0].textContent = r.request_id;
      cells[0].style.color = `hsl(${hue(r.request_id)} 65% 65%)`;
    }
    setText(cells[1], r.queue);
    const done = r.num_tokens ? r.num_computed_tokens / r.num_tokens : 0;
    const width = (done * 100).toFixed(1) + "%";
    if (cells[2].firstChild.firstChild.style.width !== width) cells[2].firstChild.firstChild.style.width = width;
    setText(cells[2].lastChild, `${r.num_computed_tokens} / ${r.num_tokens}`);
    setText(cells[3], r.num_cached_tokens < 0 ? "–" : String(r.num_cached_tokens));
    setText(cells[4], String(r.priority));
    setText(cells[5], String(r.num_preemptions));
    setText(cells[6], r.lora_name || "–");
  });
  const more = engine.requests.length - shown.length;
  setText($("queues-more"), more > 0 ? `and ${more} more` : "");
}

// ---- plots -------------------------------------------------------------------------------------
const PERCENTILES = [
  { key: "p50", label: "p50", color: "#63c08a" },
  { key: "p90", label: "p90", color: "#e0a24a" },
  { key: "p99", label: "p99", color: "#e06a5a" },
];
let plots = null;

function makePlots() {
  const box = $("plots");
  plots = {
    ttft: new LinePlot(box, "TTFT", PERCENTILES, formatSeconds),
    itl: new LinePlot(box, "ITL", PERCENTILES, formatSeconds),
    e2e: new LinePlot(box, "E2E latency", PERCENTILES, formatSeconds),
    throughput: new LinePlot(box, "throughput (tokens/s)", [
      { key: "generation", label: "generated", color: "#63c08a" },
      { key: "prompt", label: "prompt", color: "#6aa0e0" },
    ], formatNumber),
    kv: new LinePlot(box, "KV cache usage", [{ key: "kv", label: "used", color: "#e0a24a" }], formatPercent),
    queues: new LinePlot(box, "queue depth", [
      { key: "running", label: "running", color: "#63c08a" },
      { key: "waiting", label: "waiting", color: "#e06a5a" },
    ], formatNumber),
    budget: new LinePlot(box, "token budget used per step", [
      { key: "budget", label: "scheduled", color: "#6aa0e0" },
    ], formatNumber),
    preemptions: new LinePlot(box, "preemptions (total)", [
      { key: "preemptions", label: "total", color: "#e06a5a" },
    ], formatNumber),
  };
}

// tokens/s over the last second of samples
function rates(time, numbers) {
  state.rates.push([time, numbers.prompt_tokens_total, numbers.generation_tokens_total]);
  while (state.rates.length > 2 && state.rates[1][0] <= time - 1) state.rates.shift();
  const [t0, p0, g0] = state.rates[0];
  const dt = time - t0;
  if (dt <= 0) return { prompt: null, generation: null };
  return { prompt: (numbers.prompt_tokens_total - p0) / dt, generation: (numbers.generation_tokens_total - g0) / dt };
}

function pushPlots(engine, numbers, draw) {
  const t = engine.time;
  plots.ttft.push(t, numbers.ttft, draw);
  plots.itl.push(t, numbers.itl, draw);
  plots.e2e.push(t, numbers.e2e, draw);
  plots.throughput.push(t, rates(t, numbers), draw);
  plots.kv.push(t, { kv: numbers.kv_cache_usage }, draw);
  plots.queues.push(t, { running: numbers.num_running, waiting: numbers.num_waiting }, draw);
  plots.budget.push(t, { budget: engine.num_scheduled_tokens }, draw);
  plots.preemptions.push(t, { preemptions: engine.num_preemptions }, draw);
}

// ---- the playground ----------------------------------------------------------------------------
function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

function samplingFields() {
  const fields = {};
  for (const id of ["max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "n"]) {
    const v = numberField(id);
    if (v !== null) fields[id] = v;
  }
  const priority = numberField("priority");
  if (priority) fields.priority = priority;
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) fields.stop = stop;
  return fields;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "content";
  body.textContent = text;
  div.append(label, body);
  $("transcript").append(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return body;
}

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

// An embedding of the prompt (a server started with --runner pooling): its size, length and
// first values in the transcript, the whole vector in the node's data-embedding.
async function embed(text) {
  addMessage("input", text);
  $("prompt").value = "";
  $("send").disabled = true;
  try {
    const r = await fetch("/v1/embeddings", {
      method: "POST", headers: headers(true, ""),
      body: JSON.stringify({ model: state.model, input: text, encoding_format: "float" }),
    });
    if (!r.ok) throw await failure(r);
    const body = await r.json();
    const vector = body.data[0].embedding;
    const norm = Math.sqrt(vector.reduce((s, x) => s + x * x, 0));
    const head = vector.slice(0, 4).map((x) => x.toFixed(4)).join(", ");
    const node = addMessage("embedding", `${vector.length} values, length ${norm.toFixed(4)}: [${head}, ...]`);
    node.dataset.embedding = JSON.stringify(vector);
    $("request-info").textContent = `${body.id}: ${body.usage.prompt_tokens} prompt tokens`;
  } catch (e) {
    addMessage("error", e.message);
  } finally {
    $("send").disabled = false;
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim()) return;
  if (mode() === "embedding") return embed(text);
  const chat = mode() === "chat";
  const body = { model: state.model, stream: true, stream_options: { include_usage: true }, ...samplingFields() };
  if (chat) {
    const system = $("system").value.trim();
    const messages = system ? [{ role: "system", content: system }] : [];
    body.messages = [...messages, ...state.history, { role: "user", content: text }];
  } else body.prompt = text;
  addMessage(chat ? "user" : "prompt", text);
  $("prompt").value = "";
  const outputs = [];
  const abort = new AbortController();
  state.abort = abort;
  $("send").disabled = true;
  $("stop-request").disabled = false;
  const started = performance.now();
  let first = null;
  try {
    const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers(true, ""), body: JSON.stringify(body), signal: abort.signal,
    });
    if (!r.ok) throw await failure(r);
    const replica = r.headers.get("x-pagoda-replica") || "";
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      state.last = { id: chunk.id, replica };
      for (const choice of chunk.choices || []) {
        const piece = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
        if (!outputs[choice.index]) outputs[choice.index] = { node: addMessage(chat ? "assistant" : "completion", ""), text: "" };
        if (piece && first === null) first = performance.now();
        outputs[choice.index].text += piece;
        const node = outputs[choice.index].node;
        node.textContent = outputs[choice.index].text;
        node.dataset.chunks = String(Number(node.dataset.chunks || 0) + (piece ? 1 : 0));
      }
      if (chunk.usage) {
        const ttft = first === null ? "" : `, TTFT ${formatSeconds((first - started) / 1000)}`;
        $("request-info").textContent = `${chunk.id}: ${chunk.usage.prompt_tokens} prompt + ` +
          `${chunk.usage.completion_tokens} completion tokens${ttft}` + (replica ? `, replica ${replica}` : "");
      }
    }
    if (chat) state.history.push({ role: "user", content: text }, { role: "assistant", content: outputs[0] ? outputs[0].text : "" });
  } catch (e) {
    if (!abort.signal.aborted) addMessage("error", e.message);
  } finally {
    state.abort = null;
    $("send").disabled = false;
    $("stop-request").disabled = true;
    $("explain").disabled = state.last === null;
  }
}

// ---- explain -----------------------------------------------------------------------------------
function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

async function explainLast() {
  const box = $("explanation");
  box.replaceChildren();
  if (!state.last) return;
  try {
    // pinned to the replica that served it: only that one keeps its explanation
    const found = await getJSON(`/v1/requests/${encodeURIComponent(state.last.id)}/explain`, state.last.replica);
    for (const sample of found.samples) box.append(renderSample(sample));
  } catch (e) {
    box.textContent = e.message;
  }
}

function renderSample(sample) {
  const div = document.createElement("div");
  const summary = document.createElement("div");
  summary.className = "summary";
  const waited = Object.entries(sample.steps_waited).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  summary.textContent = `${sample.request_id}: finished (${sample.finish_reason}) at step ` +
    `${sample.finish_step}; cached prompt tokens ${sample.num_cached_prompt_tokens}, ` +
    `${sample.num_prefill_chunks} prefill chunks, ${sample.num_decode_steps} decode steps, ` +
    `${sample.num_preemptions} preemptions; steps waited: ${waited}; ` +
    `in ${formatPercent(sample.share_of_steps)} of the engine's steps` +
    (sample.speculative ? `; speculative: ${sample.speculative.num_accepted_tokens} of ` +
      `${sample.speculative.num_draft_tokens} drafts accepted in ${sample.speculative.num_verifications} steps` : "");
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th>event</th><th>steps</th><th>detail</th></tr></thead>";
  const tbody = document.createElement("tbody");
  for (const entry of sample.timeline) {
    const { event, step, num_steps, ...detail } = entry;
    const tr = document.createElement("tr");
    tr.dataset.event = event;
    const span = num_steps > 1 ? `${step}–${step + num_steps - 1} (${num_steps})` : String(step);
    const shown = (v) => (Array.isArray(v) ? (v.length ? v.join(" ") : "none") : v);
    const text = Object.entries(detail).map(([k, v]) => `${k}: ${shown(v)}`).join(", ");
    tr.append(cell(event), cell(span), cell(text));
    tbody.append(tr);
  }
  table.append(tbody);
  div.append(summary, table);
  return div;
}

// ---- a load to watch ----------------------------------------------------------------------------
// A browser opens at most 6 connections to a server (one is the feed), so the load's prompts go
// as batches (a completions request with a list of prompts) over LOAD_CONNECTIONS requests.
const LOAD_CONNECTIONS = 4;
const LOAD_PREFIX = "You are a helpful assistant on a busy server. Every request starts with these " +
  "same instructions, so their first KV blocks are computed once and shared through the prefix " +
  "cache: watch for blocks with a ref count above one. Answer briefly and precisely. ";

async function startLoad() {
  const n = numberField("load-n") || 8, tokens = numberField("load-tokens") || 64;
  const label = $("load-state");
  let done = 0, failed = 0;
  label.textContent = `0 / ${n} done`;
  $("load").disabled = true;
  const prompts = Array.from({ length: n }, (_, i) => `${LOAD_PREFIX}Question ${i}: tell me a story about the number ${i}.`);
  const batches = Array.from({ length: Math.min(LOAD_CONNECTIONS, n) }, (_, k) => prompts.filter((_, i) => i % LOAD_CONNECTIONS === k));
  const one = async (batch) => {
    try {
      const r = await fetch("/v1/completions", {
        method: "POST", headers: headers(true, ""),
        body: JSON.stringify({ model: state.model, prompt: batch, max_tokens: tokens, temperature: 0.8, ignore_eos: true }),
      });
      if (!r.ok) throw await failure(r);
      await r.json();
      done += batch.length;
    } catch (e) {
      failed += batch.length;
      label.title = e.message;
    }
    label.textContent = `${done} / ${n} done` + (failed ? `, ${failed} failed` : "");
  };
  await Promise.all(batches.map(one));
  $("load").disabled = false;
}

// ---- start ---------------------------------------------------------------------------------------
function start() {
  $("api-key").value = state.key;
  $("api-key").addEventListener("change", () => {
    state.key = $("api-key").value;
    localStorage.setItem("pagoda.apiKey", state.key);
    loadModel().then(loadReplicas).then(restartFeed);
  });
  $("replica").addEventListener("change", () => { state.replica = $("replica").value; restartFeed(); });
  $("refresh").value = state.refresh;
  $("refresh").addEventListener("change", () => {
    state.refresh = $("refresh").value;
    localStorage.setItem("pagoda.refresh", state.refresh);
    restartFeed();
  });
  $("send").addEventListener("click", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
  });
  $("stop-request").addEventListener("click", () => state.abort && state.abort.abort());
  $("clear").addEventListener("click", () => {
    state.history = [];
    $("transcript").replaceChildren();
    $("explanation").replaceChildren();
  });
  $("explain").addEventListener("click", explainLast);
  $("load").addEventListener("click", startLoad);
  $("pool").addEventListener("mousemove", poolTip);
  $("pool").addEventListener("mouseleave", () => { $("pool-tip").hidden = true; });
  makePlots();
  loadModel().then(loadReplicas).then(runFeed);
}

start();
