// TraceView: renders a program run's trace events (docs/studio.md) into a DOM tree, one event at
// a time, so a live stream and a replayed history entry draw the same way. A node's text spans
// (.seg) concatenate to exactly that node's own text; labels live in CSS, never in the text.
"use strict";

const TraceView = (() => {
  const SOURCES = ["prompt", "template", "generated", "select", "join", "other"];

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function fmt(x, digits) {
    return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
  }

  function where(site) {
    if (!site || !site.line) return "";
    const file = String(site.file || "").split("/").pop();
    return `${file}:${site.line}`;
  }

  class Run {
    constructor(container, program) {
      this.container = container;
      this.program = program;
      this.nodes = new Map();
      this.forks = new Map();
      this.events = [];
      this.done = null;
      this.errors = [];
    }

    apply(ev) {
      this.events.push(ev);
      const handler = HANDLERS[ev.type];
      if (handler) handler(this, ev);
    }

    node(id) {
      const ns = this.nodes.get(id);
      if (!ns) throw new Error(`trace event for unknown node ${id}`);
      return ns;
    }
  }

  function newNode(run, ev) {
    const sec = el("section", ev.parent ? "node branch" : "node root");
    sec.dataset.node = ev.node;
    const head = el("header", "node-head");
    const title = ev.parent ? `branch ${ev.index + 1}` : run.program || "program";
    const h = el(ev.parent ? "h4" : "h3", "node-title", title);
    head.append(h);
    const stats = el("p", "node-stats", "running…");
    head.append(stats);
    const body = el("div", "node-body");
    sec.append(head, body);
    sec.setAttribute("aria-label", `${title} (${ev.node})`);
    const ns = { id: ev.node, sec, body, stats, segs: [], block: null, gen: null, pendingScores: null,
                 prompt: 0, cached: 0, generated: 0, ttft: null, rate: null, done: false };
    run.nodes.set(ev.node, ns);
    if (!ev.parent) {
      run.container.append(sec);
    } else {
      forkBlock(run, run.node(ev.parent), ev.fork).branches.append(sec);
    }
    return ns;
  }

  function forkBlock(run, parent, forkId) {
    let fb = run.forks.get(forkId);
    if (!fb) {
      const box = el("div", "fork");
      box.dataset.fork = forkId;
      const label = el("p", "fork-label", "fork");
      const branches = el("div", "branches");
      box.append(label, branches);
      parent.body.append(box);
      parent.block = null;
      fb = { box, label, branches };
      run.forks.set(forkId, fb);
    }
    return fb;
  }

  function textBlock(ns) {
    if (!ns.block) {
      ns.block = el("div", "text");
      ns.body.append(ns.block);
    }
    return ns.block;
  }

  function segClasses(ev) {
    const cls = ["seg", SOURCES.includes(ev.source) ? ev.source : "other"];
    if (ev.role) cls.push(`role-${ev.role}`);
    for (const f of ev.flags || []) cls.push(f.replace("_", "-"));
    return cls.join(" ");
  }

  function addText(run, ev) {
    const ns = run.node(ev.node);
    const span = el("span", segClasses(ev), ev.text);
    span.dataset.start = ev.start;
    if (ev.ids) span.dataset.ids = ev.ids.join(" ");
    const notes = [];
    if (ev.var) notes.push(`${ev.source === "select" ? "select" : "gen"} ${ev.var}`);
    if (ev.constraint) notes.push(`constrained by ${ev.constraint.kind}: ${ev.constraint.name}`);
    if ((ev.flags || []).includes("jump_forward")) notes.push("written by the grammar (jump-forward)");
    if (ev.ids) notes.push(`${ev.ids.length} token(s): ${ev.ids.join(" ")}`);
    if (notes.length) span.title = notes.join("\n");
    if (ev.source === "generated" && ns.gen && !ns.gen.started) {
      ns.gen.started = true;
      span.classList.add("gen-start");
      span.dataset.label = ns.gen.constraint ? `${ns.gen.var || "gen"} · ${ns.gen.constraint.kind}` : ns.gen.var || "gen";
    }
    textBlock(ns).append(span);
    ns.segs.push({ span, start: ev.start, len: ev.text.length });
    if (ev.source === "select" && ns.pendingScores) {
      ns.body.append(ns.pendingScores);
      ns.pendingScores = null;
      ns.block = null;
    }
  }

  // Give chars [from, to) of a node's text the class cls, splitting spans at the edges.
  function markRange(ns, from, to, cls) {
    if (to <= from) return;
    for (let i = 0; i < ns.segs.length; i++) {
      const s = ns.segs[i];
      const end = s.start + s.len;
      if (end <= from || s.start >= to) continue;
      if (s.start < from) { splitSeg(ns, i, from - s.start); continue; }
      if (end > to) splitSeg(ns, i, to - s.start);
      ns.segs[i].span.classList.add(cls);
    }
  }

  function splitSeg(ns, i, at) {
    const s = ns.segs[i];
    const text = s.span.textContent;
    const right = s.span.cloneNode(false);
    right.classList.remove("gen-start");
    right.removeAttribute("data-label");
    right.textContent = text.slice(at);
    right.dataset.start = s.start + at;
    s.span.textContent = text.slice(0, at);
    s.span.after(right);
    ns.segs.splice(i + 1, 0, { span: right, start: s.start + at, len: s.len - at });
    s.len = at;
  }

  function showStats(ns) {
    const parts = [
      `prompt ${ns.prompt} tok (${ns.cached} cached, ${ns.prompt - ns.cached} computed)`,
      `generated ${ns.generated}`,
      `TTFT ${ns.ttft === null ? "–" : fmt(ns.ttft, 2) + " s"}`,
      `${ns.rate === null ? "–" : fmt(ns.rate, 1)} tok/s`,
    ];
    ns.stats.textContent = parts.join(" · ");
  }

  function scoresTable(ev) {
    const table = el("table", "scores");
    table.dataset.var = ev.var || "";
    table.append(el("caption", null, `select ${ev.var || ""} · ${ev.method}${where(ev.site) ? " · " + where(ev.site) : ""}`));
    const head = el("tr");
    const keys = Object.keys(ev.scores || {});
    head.append(el("th", null, "choice"));
    for (const k of keys) head.append(el("th", null, k.replace(/_/g, " ")));
    table.append(head);
    ev.choices.forEach((choice, i) => {
      const row = el("tr", i === ev.index ? "chosen" : "");
      const cell = el("td", null, (i === ev.index ? "✓ " : "") + choice);
      row.append(cell);
      for (const k of keys) row.append(el("td", "num", fmt((ev.scores[k] || [])[i], 3)));
      if (i === ev.index) row.setAttribute("aria-label", `${choice}: chosen`);
      table.append(row);
    });
    return table;
  }

  function errorBox(ev) {
    const box = el("div", "error-box");
    box.setAttribute("role", "alert");
    box.append(el("strong", null, `${ev.error_type}: ${ev.message}`));
    if (ev.line) {
      const loc = el("p", "error-where", `${ev.file} line ${ev.line}${ev.function ? " in " + ev.function : ""}`);
      box.append(loc);
      if (ev.code) box.append(el("pre", "error-code", ev.code));
    }
    return box;
  }

  const HANDLERS = {
    run(run, ev) { run.program = ev.program; },
    node(run, ev) { newNode(run, ev); },
    fork(run, ev) {
      const fb = forkBlock(run, run.node(ev.node), ev.fork);
      const site = where(ev.site);
      fb.label.textContent = `fork · ${ev.branches.length} branches${site ? " · " + site : ""}`;
    },
    text(run, ev) { addText(run, ev); },
    prompt(run, ev) {
      const ns = run.node(ev.node);
      markRange(ns, ev.start, ev.cached_end, "cached");
      markRange(ns, ev.cached_end, ev.end, "computed");
      ns.prompt += ev.ids.length;
      ns.cached += ev.cached_tokens;
      showStats(ns);
    },
    gen(run, ev) { run.node(ev.node).gen = { var: ev.var, constraint: ev.constraint, started: false }; },
    gen_done(run, ev) {
      const ns = run.node(ev.node);
      ns.generated += ev.completion_tokens || 0;
      if (ns.ttft === null && ev.ttft_s !== undefined) ns.ttft = ev.ttft_s;
      if (ev.tokens_per_s) ns.rate = ev.tokens_per_s;
      ns.gen = null;
      showStats(ns);
    },
    select(run, ev) { run.node(ev.node).pendingScores = scoresTable(ev); },
    join(run, ev) {
      const ns = run.node(ev.node);
      const fb = run.forks.get(ev.fork);
      const mark = el("p", "join-label", `join (${ev.mode}) · ${ev.branches.length} branches`);
      if (fb) fb.box.append(mark);
      ns.block = null;
    },
    node_done(run, ev) {
      const ns = run.node(ev.node);
      ns.done = true;
      ns.sec.classList.add("done");
      const st = ev.stats || {};
      ns.prompt = st.prompt_tokens ?? ns.prompt;
      ns.cached = st.cached_tokens ?? ns.cached;
      ns.generated = st.generated_tokens ?? ns.generated;
      ns.ttft = st.ttft_s ?? ns.ttft;
      ns.rate = st.tokens_per_s ?? ns.rate;
      showStats(ns);
    },
    error(run, ev) {
      run.errors.push(ev);
      const ns = ev.node ? run.nodes.get(ev.node) : null;
      const box = errorBox(ev);
      if (ns) { ns.body.append(box); ns.block = null; } else { run.container.append(box); }
    },
    done(run, ev) { run.done = ev; },
  };

  return { Run, errorBox };
})();
