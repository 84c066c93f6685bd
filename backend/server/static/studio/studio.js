// The studio page: the registered programs as forms, a run streamed from
// POST /programs/{name}/trace into a TraceView, a bounded history of finished runs (each
// downloadable as JSON) and the engine's live counters. Leaving the page or pressing Stop closes
// the stream, which cancels the run on the server.
"use strict";

(() => {
  const HISTORY_MAX = 20;
  const METRICS_EVERY_MS = 1000;
  const METRICS_WINDOW = 300; // samples kept: five minutes at one a second
  const $ = (id) => document.getElementById(id);
  const state = { programs: [], current: null, controller: null, history: [], samples: [] };

  // ---- programs and their argument forms ----------------------------------------------------

  async function loadPrograms() {
    const r = await fetch("/programs");
    if (r.status === 401) return needKey();
    if (!r.ok) {
      const msg = r.status === 404 ? "No programs are registered: start the server with --programs FILE." : `GET /programs: ${r.status}`;
      return setStatus(msg);
    }
    state.programs = (await r.json()).programs;
    const select = $("program");
    select.replaceChildren(...state.programs.map((p) => new Option(p.name, p.name)));
    $("run").disabled = state.programs.length === 0;
    buildForm();
  }

  function fieldKind(arg, schema) {
    const type = schema.type || (arg.default === null ? null : typeof arg.default);
    if (type === "integer" || type === "number" || type === "boolean") return type;
    if (type === "array" || type === "object") return "json";
    return "string";
  }

  function buildForm() {
    const prog = state.programs.find((p) => p.name === $("program").value);
    const box = $("args");
    box.replaceChildren();
    $("program-doc").textContent = prog ? prog.doc : "";
    if (!prog) return;
    const props = (prog.schema && prog.schema.properties) || {};
    for (const arg of prog.arguments) {
      const kind = fieldKind(arg, props[arg.name] || {});
      const id = `arg-${arg.name}`;
      const label = document.createElement("label");
      label.htmlFor = id;
      label.textContent = `${arg.name}${arg.required ? " *" : ""}`;
      let input;
      if (kind === "boolean") {
        input = document.createElement("input");
        input.type = "checkbox";
        input.checked = Boolean(arg.default);
      } else if (kind === "string" && !(typeof arg.default === "string" && arg.default.length < 60)) {
        input = document.createElement("textarea");
        input.rows = 2;
        input.value = arg.default ?? "";
      } else {
        input = document.createElement("input");
        input.type = kind === "integer" || kind === "number" ? "number" : "text";
        if (kind === "integer") input.step = "1";
        if (kind === "number") input.step = "any";
        input.value = kind === "json" ? JSON.stringify(arg.default ?? null) : arg.default ?? "";
      }
      input.id = id;
      input.name = arg.name;
      input.dataset.kind = kind;
      input.required = arg.required && kind !== "boolean";
      const row = document.createElement("div");
      row.className = kind === "boolean" ? "field check" : "field";
      row.append(label, input);
      box.append(row);
    }
  }

  function readArgs() {
    const args = {};
    for (const input of $("args").querySelectorAll("input, textarea")) {
      const kind = input.dataset.kind;
      if (kind === "boolean") { args[input.name] = input.checked; continue; }
      if (input.value === "" && !input.required) continue;
      if (kind === "integer" || kind === "number") args[input.name] = Number(input.value);
      else if (kind === "json") args[input.name] = JSON.parse(input.value);
      else args[input.name] = input.value;
    }
    return args;
  }

  // ---- a run ---------------------------------------------------------------------------------

  async function run(event) {
    if (event) event.preventDefault();
    if (state.controller) return;
    const name = $("program").value;
    let body;
    try {
      body = { args: readArgs() };
    } catch (e) {
      return setStatus(`Arguments: ${e.message}`);
    }
    const maxNew = $("max-new-tokens").value;
    if (maxNew !== "") body.max_new_tokens = Number(maxNew);
    const temp = $("temperature").value;
    if (temp !== "") body.temperature = Number(temp);
    const entry = { id: Date.now(), program: name, request: body, started: new Date().toISOString(), events: [] };
    const view = showRun(entry);
    state.controller = new AbortController();
    setRunning(true);
    setStatus(`Running ${name}…`);
    try {
      const r = await fetch(`/programs/${encodeURIComponent(name)}/trace`, {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(body),
        signal: state.controller.signal,
      });
      if (r.status === 401) return needKey();
      if (!r.ok) {
        const err = await r.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || `HTTP ${r.status}`);
      }
      await readEvents(r.body, (ev) => view.apply(ev));
      finishRun(entry, view);
    } catch (e) {
      if (e.name === "AbortError") setStatus(`Stopped ${name}: the server cancelled the run.`);
      else setStatus(`Run failed: ${e.message}`);
    } finally {
      state.controller = null;
      setRunning(false);
    }
  }

  async function readEvents(stream, onEvent) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  function finishRun(entry, view) {
    entry.events = view.events;
    const done = view.done;
    entry.ok = Boolean(done && done.ok);
    entry.elapsed = done ? done.elapsed_s : null;
    state.history.unshift(entry);
    state.history.length = Math.min(state.history.length, HISTORY_MAX);
    renderHistory(entry.id);
    const err = view.errors[0];
    setStatus(entry.ok ? `Finished ${entry.program} in ${entry.elapsed.toFixed(2)} s.`
      : `${entry.program} failed: ${err ? `${err.error_type}: ${err.message}${err.line ? ` (line ${err.line})` : ""}` : "no result"}`);
  }

  function showRun(entry) {
    state.current = entry;
    const tree = $("tree");
    tree.replaceChildren();
    $("run-title").textContent = `${entry.program} · ${entry.started.replace("T", " ").slice(0, 19)}`;
    $("download").disabled = !entry.events.length;
    const view = new TraceView.Run(tree, entry.program);
    for (const ev of entry.events) view.apply(ev);
    if (!entry.events.length) entry.events = view.events;
    return view;
  }

  function renderHistory(selectedId) {
    const list = $("history-list");
    list.replaceChildren(...state.history.map((h) => {
      const li = document.createElement("li");
      const b = document.createElement("button");
      b.type = "button";
      b.className = h.ok ? "ok" : "failed";
      b.textContent = `${h.program} · ${h.ok ? "ok" : "error"} · ${h.elapsed === null ? "–" : h.elapsed.toFixed(2) + " s"}`;
      b.setAttribute("aria-current", String(h.id === selectedId));
      b.addEventListener("click", () => {
        if (state.controller) return setStatus("A run is in progress: stop it (Escape) to browse finished runs.");
        showRun(h);
        renderHistory(h.id);
      });
      li.append(b);
      return li;
    }));
    $("download").disabled = !state.current || !state.current.events.length;
  }

  function download() {
    const h = state.current;
    if (!h) return;
    const blob = new Blob([JSON.stringify(h, null, 1)], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = `${h.program}-${h.id}.json`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  function setRunning(on) {
    $("run").disabled = on || state.programs.length === 0;
    $("stop").disabled = !on;
    document.body.classList.toggle("running", on);
  }

  function setStatus(text) { $("status").textContent = text; }

  function needKey() {
    setStatus("The server needs its API key: reload the page to sign in.");
  }

  // ---- live metrics --------------------------------------------------------------------------

  async function pollMetrics() {
    try {
      const r = await fetch("/studio/api/metrics");
      if (r.ok) showMetrics(await r.json());
    } catch (e) {
      $("m-state").textContent = "server unreachable";
    }
    setTimeout(pollMetrics, METRICS_EVERY_MS);
  }

  function showMetrics(m) {
    const prev = state.samples[state.samples.length - 1];
    const rate = prev ? Math.max(0, (m.generated_tokens - prev.generated_tokens) / Math.max(m.time - prev.time, 1e-3)) : 0;
    state.samples.push({ ...m, rate });
    if (state.samples.length > METRICS_WINDOW) state.samples.shift();
    const prompt = m.cached_prompt_tokens + m.computed_prompt_tokens;
    $("m-running").textContent = m.num_running;
    $("m-waiting").textContent = m.num_waiting;
    $("m-kv").textContent = `${(100 * (1 - m.kv_free_slots / m.kv_total_slots)).toFixed(1)}%`;
    $("m-kv").title = `${m.kv_total_slots - m.kv_free_slots} of ${m.kv_total_slots} slots used, ${m.kv_cached_slots} held by the cache`;
    $("m-hit").textContent = prompt ? `${((100 * m.cached_prompt_tokens) / prompt).toFixed(1)}%` : "–";
    $("m-rate").textContent = rate.toFixed(1);
    $("m-state").textContent = `${m.programs_running} program run(s)`;
    drawSparkline();
  }

  function drawSparkline() {
    const svg = $("m-spark");
    const w = 300, h = 40;
    const rates = state.samples.map((s) => s.rate);
    const top = Math.max(1, ...rates);
    const pts = rates.map((r, i) => `${(w * (i + METRICS_WINDOW - rates.length)) / (METRICS_WINDOW - 1)},${h - (h * r) / top}`);
    $("m-line").setAttribute("points", pts.join(" "));
    svg.setAttribute("aria-label", `tokens per second over the last ${Math.round(rates.length / 60)} min, peak ${top.toFixed(1)}`);
  }

  // ---- wiring ---------------------------------------------------------------------------------

  function init() {
    $("program").addEventListener("change", buildForm);
    $("run-form").addEventListener("submit", run);
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("download").addEventListener("click", download);
    document.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run(e);
      else if (e.key === "Escape" && state.controller) state.controller.abort();
    });
    loadPrograms().catch((e) => setStatus(`Could not load programs: ${e.message}`));
    pollMetrics();
  }

  init();
})();
