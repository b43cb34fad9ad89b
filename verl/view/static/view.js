// verl view: the four views of a run (metrics, samples, episodes, tokens).
// Live page: asks the server's /api/* and polls. Report: answers the same questions from the embedded data.
// Everything from a run is text: it reaches the document through textContent / setAttribute, never as markup,
// and names handed to plotly (which reads a little HTML in labels) are escaped first.
(function () {
  "use strict";
  const dataEl = document.getElementById("verl-data");
  const DATA = dataEl ? JSON.parse(dataEl.textContent) : null;
  const LIVE = DATA === null;
  const POLL_MS = 3000;
  const VIEWS = ["metrics", "samples", "episodes", "tokens"];
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#7f7f7f"];
  const PREFIX_ORDER = ["reward", "val", "actor", "critic", "rollout", "rollout_corr", "advantages", "timing",
    "async", "episode", "perf", "response", "prompt"];
  const STATUSES = ["ok", "timeout", "failed", "restarted", "truncated"];
  let RUNS = [];

  // ------------------------------------------------------------------ helpers
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  function clear(el) { while (el.firstChild) el.removeChild(el.firstChild); }
  function esc(s) { return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }
  function fmt(v) {
    if (v === null || v === undefined) return "";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    return String(Number(v.toPrecision(6)));
  }
  function colour(run) { return COLORS[run % COLORS.length]; }
  function runName(run) { const r = RUNS[run]; return r ? r.name : "run " + run; }
  const optionItems = new WeakMap();
  function options(select, items, selected) {
    const signature = JSON.stringify(items);
    if (optionItems.get(select) !== signature) {  // rebuilt only when changed: a poll must not close an open menu
      clear(select);
      for (const [value, label] of items) select.append(h("option", { value: value, text: label }));
      optionItems.set(select, signature);
    }
    if (items.some(([v]) => String(v) === String(selected))) select.value = String(selected);
  }
  function debounce(fn, ms) { let t = null; return () => { clearTimeout(t); t = setTimeout(fn, ms); }; }
  class ApiError extends Error {}

  function readHash() {
    const raw = location.hash.slice(1);
    const i = raw.indexOf("?");
    const view = i < 0 ? raw : raw.slice(0, i);
    return { view: VIEWS.includes(view) ? view : "metrics", params: new URLSearchParams(i < 0 ? "" : raw.slice(i + 1)) };
  }
  const lastHash = {};  // each view's own address, so a tab keeps its filters when the user comes back to it
  function writeHash(view, params) {
    const entries = [...params.entries()].filter(([, v]) => v !== "" && v !== null && v !== undefined);
    const q = new URLSearchParams(entries).toString();
    const hash = "#" + view + (q ? "?" + q : "");
    lastHash[view] = hash;
    if (location.hash === hash) return;
    try { history.replaceState(null, "", hash); } catch (e) { /* a browser that refuses it on file:// */ }
  }

  // ------------------------------------------------------------------ the data: server or embedded
  async function api(route, params) {
    if (!LIVE) {
      try { return LOCAL[route](params || {}); } catch (e) { throw new ApiError(e.message); }
    }
    const res = await fetch("api/" + route + "?" + new URLSearchParams(params || {}).toString(), { cache: "no-store" });
    let body = null;
    try { body = await res.json(); } catch (e) { throw new ApiError("the server's answer was not JSON (HTTP " + res.status + ")"); }
    if (!res.ok) throw new ApiError(body && body.error ? body.error : "HTTP " + res.status);
    return body;
  }
  function isAll(v) { return v === undefined || v === null || v === "" || v === "all"; }
  function localSource(p) {
    const byRun = DATA.rows[p.run || 0];
    if (!byRun) throw new Error("no run " + p.run);
    const rows = byRun[p.source || "rollouts"];
    if (!rows) throw new Error("source " + p.source + ": choose samples or rollouts");
    return rows;
  }
  function textKey(r, key) { return r[key] === null || r[key] === undefined ? "" : String(r[key]); }
  function sortKey(key) {
    if (key === "reward" || key === "advantage") return r => r[key];
    if (key.startsWith("r:")) return r => (r.rewards && key.slice(2) in r.rewards ? r.rewards[key.slice(2)] : null);
    if (key === "step" || key === "response_length") return r => (r[key] === null ? -1 : r[key]);
    return null;
  }
  function localRows(p) {
    const step = isAll(p.step) ? null : Number(p.step);
    const num = v => (isAll(v) ? null : Number(v));
    const rmin = num(p.rmin), rmax = num(p.rmax);
    let out = localSource(p).filter(r => (step === null || r.step === step) && (!p.ds || r.data_source === p.ds)
      && (rmin === null || (r.reward !== null && r.reward >= rmin)) && (rmax === null || (r.reward !== null && r.reward <= rmax))
      && (!p.ph || r.ph === p.ph) && (p.episodes !== "1" || r.episode)
      && (!p.status || (r.episode && (p.status === "bad" ? r.episode.status !== "ok" : r.episode.status === p.status))));
    if (p.sort) {
      const desc = p.desc === "1", k = sortKey(p.sort);
      if (k) {
        const nanLast = ["reward", "advantage"].includes(p.sort) || p.sort.startsWith("r:");
        out = out.slice().sort((a, b) => {
          const x = k(a), y = k(b);
          if (nanLast && (x === null || y === null)) return (x === null) - (y === null);
          return desc ? y - x : x - y;
        });
      } else {
        out = out.slice().sort((a, b) => { const x = textKey(a, p.sort), y = textKey(b, p.sort); return (x < y ? -1 : x > y ? 1 : 0) * (desc ? -1 : 1); });
      }
    }
    if (p.q) {
      const n = p.q.toLowerCase();
      out = out.filter(r => r.prompt.toLowerCase().includes(n) || r.response.toLowerCase().includes(n)
        || (r.episode && r.episode.turns.some(t => t.text.toLowerCase().includes(n))));
    }
    const offset = Number(p.offset || 0), limit = Math.min(Number(p.limit || 50), 200);
    return { rows: out.slice(offset, offset + limit), total: out.length, next: offset + limit < out.length ? offset + limit : null, scanned: 0 };
  }
  function countSteps(rows) {
    const m = new Map();
    for (const r of rows) m.set(r.step, (m.get(r.step) || 0) + 1);
    return [...m.entries()].sort((a, b) => a[0] - b[0]);
  }
  const LOCAL = {
    runs: () => ({ runs: DATA.runs }),
    metrics: p => { const m = DATA.metrics[p.run || 0]; const since = Number(p.since || 0); return Object.assign({}, m, { start: since, rows: m.rows.slice(since) }); },
    steps: p => {
      const rows = localSource(p), names = new Set(), sources = new Set();
      for (const r of rows) { sources.add(r.data_source); for (const k of Object.keys(r.rewards || {})) names.add(k); }
      return { steps: countSteps(rows), data_sources: [...sources].sort(), reward_names: [...names], rows: rows.length,
        episodes: rows.filter(r => r.episode).length, indexed_bytes: 0, size: 0, bad_lines: 0, problems: [] };
    },
    rows: localRows,
    tokens: p => {
      const rows = DATA.tokens[p.run || 0] || [], names = new Set();
      for (const r of rows) for (const k of Object.keys(r.values)) names.add(k);
      const steps = countSteps(rows);
      const step = isAll(p.step) ? (steps.length ? steps[steps.length - 1][0] : null) : Number(p.step);
      return { steps: steps, names: [...names], rows: rows.length, step: step, bad_lines: 0, problems: [],
        responses: rows.filter(r => r.step === step).map(r => ({ id: r.id, step: r.step, group: r.group, prompt: r.prompt.slice(0, 120), n: r.tokens.length, sample: r.sample })) };
    },
    token: p => { const r = (DATA.tokens[p.run || 0] || []).find(x => x.id === Number(p.id)); if (!r) throw new Error("no response " + p.id + " in this report"); return r; },
  };

  // ------------------------------------------------------------------ notes and status
  const notes = { fixed: LIVE ? [] : DATA.notes.slice(), live: new Map() };
  function showNotes() {
    const el = document.getElementById("notes");
    clear(el);
    for (const n of [...notes.fixed, ...notes.live.values()]) el.append(h("div", { text: n }));
  }
  function problemNote(key, label, ans) {
    if (ans && ans.bad_lines) notes.live.set(key, label + ": " + ans.bad_lines + " unreadable line(s) skipped; first: " + (ans.problems[0] || "?"));
    else notes.live.delete(key);
    showNotes();
  }
  function setStatus(text) { document.getElementById("status").textContent = text; }
  // A training rollout's link to its token values (the tokens.jsonl row of the same step and `sample` number).
  function tokensLink(run, r) {
    if (r.sample === null || r.sample === undefined || r.step === null) return null;
    const q = new URLSearchParams(run === "0" ? {} : { run: run });
    q.set("step", r.step);
    q.set("sample", r.sample);
    return h("a", { class: "tokens-link", href: "#tokens?" + q.toString(), title: "this response's token values", text: "tokens" });
  }
  function runSelect(onchange) {
    const sel = h("select", { onchange: onchange });
    options(sel, RUNS.map(r => [r.id, r.name]), 0);
    return RUNS.length > 1 ? [h("label", {}, "run", sel), sel] : [null, sel];
  }

  // ------------------------------------------------------------------ metrics
  function ema(ys, a) {
    if (!(a > 0)) return ys;
    let last = 0, w = 0;
    return ys.map(y => { if (y === null) return null; last = last * a + (1 - a) * y; w = w * a + (1 - a); return last / w; });
  }
  function groupOf(key) { const i = key.indexOf("/"); return i < 0 ? "other" : key.slice(0, i); }
  function groupRank(g) { const i = PREFIX_ORDER.indexOf(g); return i < 0 ? PREFIX_ORDER.length : i; }

  const metricsView = {
    el: document.getElementById("view-metrics"), built: false, runs: new Map(), charts: new Map(), shape: "",
    build() {
      this.smooth = h("input", { type: "range", min: "0", max: "0.99", step: "0.01", value: "0" });
      this.smoothLabel = h("span", { text: "0" });
      this.filter = h("input", { type: "search", placeholder: "metric name contains..." });
      const changed = () => { this.smoothLabel.textContent = this.smooth.value; this.saveHash(); this.render(true); };
      this.smooth.addEventListener("input", changed);
      this.filter.addEventListener("input", debounce(changed, 250));
      this.info = h("span", { class: "muted" });
      this.error = h("div", { class: "error" });
      this.body = h("div");
      this.el.append(h("div", { class: "controls" }, h("label", {}, "smoothing (EMA)", this.smooth, this.smoothLabel),
        h("label", {}, "filter", this.filter), this.info), this.error, this.body);
      this.built = true;
    },
    saveHash() { writeHash("metrics", new URLSearchParams({ smooth: this.smooth.value === "0" ? "" : this.smooth.value, filter: this.filter.value })); },
    async show(params) {
      if (!this.built) this.build();
      if (params.has("smooth")) this.smooth.value = params.get("smooth");
      this.smoothLabel.textContent = this.smooth.value;
      this.filter.value = params.get("filter") || "";
      await this.load();
      this.render(true);
    },
    async poll() { if (await this.load()) this.render(false); },
    async load() {
      let changed = false;
      for (const run of RUNS) {
        let d = this.runs.get(run.id);
        if (!d) { d = { generation: null, rows: [], best: null }; this.runs.set(run.id, d); }
        let ans = await api("metrics", { run: run.id, since: d.rows.length });
        if (d.generation !== null && ans.generation !== d.generation && ans.start > 0) {
          ans = await api("metrics", { run: run.id, since: 0 });  // the file was replaced: start over
        }
        if (ans.generation !== d.generation) { d.rows = []; d.generation = ans.generation; changed = true; }
        for (const row of ans.rows) d.rows.push(row);
        if (ans.rows.length || JSON.stringify(ans.best) !== JSON.stringify(d.best)) changed = true;
        d.best = ans.best;
        problemNote("metrics" + run.id, run.name + " metrics.jsonl", ans);
      }
      return changed;
    },
    specs() {
      const a = Number(this.smooth.value), filter = this.filter.value.toLowerCase();
      const series = new Map();  // key -> [{run, xs, ys}]
      const bests = [];
      for (const run of RUNS) {
        const d = this.runs.get(run.id);
        if (!d) continue;
        if (d.best) bests.push([run.id, d.best]);
        const perKey = new Map();
        for (const row of d.rows) {
          for (const key in row) {
            if (key === "step") continue;
            let s = perKey.get(key);
            if (!s) { s = { run: run.id, xs: [], ys: [] }; perKey.set(key, s); }
            s.xs.push(row.step); s.ys.push(row[key]);
          }
        }
        for (const [key, s] of perKey) { if (!series.has(key)) series.set(key, []); series.get(key).push(s); }
      }
      const keys = [...series.keys()].filter(k => !filter || k.toLowerCase().includes(filter));
      keys.sort((x, y) => groupRank(groupOf(x)) - groupRank(groupOf(y)) || (groupOf(x) < groupOf(y) ? -1 : groupOf(x) > groupOf(y) ? 1 : 0) || (x < y ? -1 : x > y ? 1 : 0));
      const specs = [];
      for (const key of keys) {
        const group = groupOf(key), isVal = group === "val", traces = [];
        for (const s of series.get(key)) {
          const c = colour(s.run), lines = isVal ? "lines+markers" : "lines";
          if (a > 0) traces.push({ x: s.xs, y: s.ys, mode: lines, line: { color: c, width: 1 }, opacity: 0.25, showlegend: false, hoverinfo: "skip" });
          traces.push({ x: s.xs, y: ema(s.ys, a), mode: lines, name: esc(runName(s.run)), line: { color: c, width: 2 } });
        }
        const shapes = [];
        for (const [run, best] of bests) {
          if (isVal) shapes.push({ type: "line", xref: "x", yref: "paper", x0: best.step, x1: best.step, y0: 0, y1: 1, line: { color: colour(run), dash: "dot", width: 1 } });
          if (best.metric === key) {
            traces.push({ x: [best.step], y: [best.value], mode: "markers", name: esc("best checkpoint: " + runName(run) + " step " + best.step),
              marker: { symbol: "star", size: 15, color: colour(run), line: { color: "#000", width: 1 } },
              hovertemplate: esc("best (" + best.source + ")") + ": step %{x}, %{y}<extra></extra>" });
          }
        }
        specs.push({ id: "m:" + key, key: key, title: key, group: group, traces: traces, shapes: shapes, best: bests.some(([, b]) => b.metric === key) });
      }
      for (const run of RUNS) {  // the step's time split by stage, stacked, one chart per run
        const d = this.runs.get(run.id);
        const stages = d ? [...new Set(d.rows.flatMap(r => Object.keys(r)))].filter(k => k.startsWith("timing/") && k !== "timing/step") : [];
        if (!stages.length || (filter && !"timing".includes(filter) && !stages.some(k => k.includes(filter)))) continue;
        const traces = stages.map((k, i) => ({ x: d.rows.filter(r => k in r).map(r => r.step), y: ema(d.rows.filter(r => k in r).map(r => r[k]), a),
          name: esc(k.slice(7)), stackgroup: "one", mode: "lines", line: { width: 0.5, color: COLORS[i % COLORS.length] } }));
        const total = d.rows.filter(r => "timing/step" in r);
        if (total.length) traces.push({ x: total.map(r => r.step), y: ema(total.map(r => r["timing/step"]), a), name: "step (total)", mode: "lines", line: { color: "#000", dash: "dot", width: 1 } });
        const at = specs.findIndex(s => s.group === "timing");
        specs.splice(at < 0 ? specs.length : at, 0, { id: "t:" + run.id, key: "timing", title: "step time by stage (seconds): " + run.name, group: "timing", traces: traces, shapes: [], wide: true });
      }
      return specs;
    },
    render(force) {
      if (!this.built || this.el.hidden) return;
      const specs = this.specs();
      const shape = specs.map(s => s.id).join("\n");
      const n = [...this.runs.values()].reduce((t, d) => t + d.rows.length, 0);
      this.info.textContent = specs.length + " charts, " + n + " rows" + (LIVE ? "" : " (report)");
      if (force || shape !== this.shape) {
        for (const c of this.charts.values()) Plotly.purge(c.div);
        this.charts.clear();
        clear(this.body);
        this.shape = shape;
        let grid = null, group = null;
        if (!specs.length) this.body.append(h("p", { class: "muted", text: "No metrics yet: metrics.jsonl is empty or missing." }));
        for (const s of specs) {
          if (s.group !== group) {
            group = s.group;
            this.body.append(h("h2", { text: group }));
            grid = h("div", { class: "charts", "data-group": group });
            this.body.append(grid);
          }
          const div = h("div", { class: "chart" });
          grid.append(h("div", { class: "chart-box" + (s.wide ? " wide" : ""), "data-metric": s.key }, h("div", { class: "chart-title", text: s.title }), div));
          this.charts.set(s.id, { div: div });
        }
      }
      for (const s of specs) {
        const c = this.charts.get(s.id);
        const layout = { margin: { l: 50, r: 10, t: 8, b: 30 }, height: 240, shapes: s.shapes, hovermode: "x unified",
          showlegend: RUNS.length > 1 || s.wide || s.best, legend: { orientation: "h", y: -0.2 }, xaxis: { title: { text: "" } }, uirevision: s.id };
        Plotly.react(c.div, s.traces, layout, { displaylogo: false, responsive: true, displayModeBar: "hover" });
      }
    },
  };

  // ------------------------------------------------------------------ samples
  const COLUMNS = {
    rollouts: [["step", "step", "num"], ["group", "group", "text"], ["data_source", "data source", "text"], ["prompt", "prompt", "text"],
      ["response", "response", "text"], ["ground_truth", "ground truth", "text"], ["reward", "reward", "num"], ["advantage", "advantage", "num"],
      ["response_length", "length", "num"]],
    samples: [["step", "step", "num"], ["data_source", "data source", "text"], ["prompt", "prompt", "text"], ["response", "response", "text"],
      ["ground_truth", "ground truth", "text"], ["reward", "score", "num"], ["extras", "reward extras", "text"]],
  };
  const samplesView = {
    el: document.getElementById("view-samples"), built: false, offset: 0, summary: null,
    build() {
      const go = () => { this.offset = 0; this.saveHash(); this.query(); };
      [this.runLabel, this.run] = runSelect(() => { this.steps(true).then(go); });
      this.source = h("select", { onchange: () => { this.steps(true).then(go); } });
      options(this.source, [["rollouts", "training rollouts (rollouts.jsonl)"], ["samples", "validation (samples.jsonl)"]], "rollouts");
      this.step = h("select", { onchange: go });
      this.q = h("input", { type: "search", placeholder: "text in prompt or response" });
      this.q.addEventListener("input", debounce(go, 300));
      this.ds = h("select", { onchange: go });
      this.rmin = h("input", { type: "text", class: "num", placeholder: "min" });
      this.rmax = h("input", { type: "text", class: "num", placeholder: "max" });
      this.rmin.addEventListener("input", debounce(go, 300));
      this.rmax.addEventListener("input", debounce(go, 300));
      this.info = h("span", { class: "muted" });
      this.error = h("div", { class: "error" });
      this.same = h("div");
      this.table = h("div");
      this.prev = h("button", { text: "previous", onclick: () => { this.offset = Math.max(0, this.offset - this.limit); this.saveHash(); this.query(); } });
      this.next = h("button", { text: "next", onclick: () => { if (this.nextOffset !== null) { this.offset = this.nextOffset; this.saveHash(); this.query(); } } });
      this.pageInfo = h("span", { class: "muted" });
      this.el.append(h("div", { class: "controls" }, this.runLabel, h("label", {}, "file", this.source), h("label", {}, "step", this.step),
        h("label", {}, "search", this.q), h("label", {}, "data source", this.ds), h("label", {}, "reward", this.rmin, "to", this.rmax), this.info),
      this.error, this.same, this.table, h("div", { class: "pager" }, this.prev, this.next, this.pageInfo));
      this.sort = ""; this.desc = false; this.limit = 50; this.nextOffset = null;
      this.built = true;
    },
    params() {
      return { run: this.run.value, source: this.source.value, step: this.step.value, q: this.q.value, ds: this.ds.value,
        rmin: this.rmin.value.trim(), rmax: this.rmax.value.trim(), sort: this.sort, desc: this.desc ? "1" : "", offset: String(this.offset) };
    },
    saveHash() {
      const p = this.params();
      if (p.offset === "0") p.offset = "";
      if (p.run === "0") p.run = "";
      if (this.ph) p.ph = this.ph;
      writeHash("samples", new URLSearchParams(p));
    },
    async show(params) {
      if (!this.built) this.build();
      this.run.value = params.get("run") || "0";
      const files = (RUNS[Number(this.run.value)] || { files: {} }).files;
      this.source.value = params.get("source") || (files["rollouts.jsonl"] || !files["samples.jsonl"] ? "rollouts" : "samples");
      this.q.value = params.get("q") || ""; this.rmin.value = params.get("rmin") || ""; this.rmax.value = params.get("rmax") || "";
      this.sort = params.get("sort") || ""; this.desc = params.get("desc") === "1"; this.offset = Number(params.get("offset") || 0);
      this.ph = params.get("ph") || "";
      if (!this.ph) clear(this.same);
      await this.steps(false, params.get("step") || "all", params.get("ds") || "");
      await this.query();
      if (this.ph) await this.samePrompt(this.ph);
    },
    async steps(reset, step, ds) {
      try {
        const s = await api("steps", { run: this.run.value, source: this.source.value });
        this.summary = s;
        options(this.step, [["all", "all steps"], ...s.steps.map(([k, n]) => [k, "step " + k + " (" + n + ")"])], reset ? "all" : step !== undefined ? step : this.step.value);
        options(this.ds, [["", "any"], ...s.data_sources.map(d => [d, d || "(none)"])], reset ? "" : ds !== undefined ? ds : this.ds.value);
        const indexing = s.size && s.indexed_bytes < s.size ? " · indexing " + Math.round(100 * s.indexed_bytes / s.size) + "%" : "";
        this.info.textContent = s.rows + " rows in " + s.steps.length + " steps" + indexing;
        problemNote("rows" + this.run.value + this.source.value, runName(Number(this.run.value)) + " " + this.source.value + ".jsonl", s);
        return s;
      } catch (e) { if (e instanceof ApiError) { this.error.textContent = e.message; return null; } throw e; }
    },
    columns() {
      const cols = COLUMNS[this.source.value].slice();
      if (this.source.value === "rollouts" && this.summary) {
        const at = cols.findIndex(c => c[0] === "reward") + 1;
        cols.splice(at, 0, ...this.summary.reward_names.map(n => ["r:" + n, n, "num"]));
      }
      return cols;
    },
    cell(row, key) { return key.startsWith("r:") ? (row.rewards || {})[key.slice(2)] : row[key]; },
    async query() {
      this.error.textContent = "";
      let ans;
      try { ans = await api("rows", Object.assign(this.params(), { limit: this.limit })); } catch (e) {
        if (e instanceof ApiError) { this.error.textContent = e.message; return; }
        throw e;
      }
      this.nextOffset = ans.next;
      const cols = this.columns();
      const head = h("tr", {}, ...cols.map(([key, label, kind]) => h("th", {
        class: kind + (this.sort === key ? " sorted" : ""), title: "sort by " + label, "data-col": key,
        onclick: () => { if (this.sort === key) this.desc = !this.desc; else { this.sort = key; this.desc = false; } this.offset = 0; this.saveHash(); this.query(); },
      }, label + (this.sort === key ? (this.desc ? " ▼" : " ▲") : ""))));
      const body = ans.rows.map(r => h("tr", { "data-id": r.id }, ...cols.map(([key, , kind]) => {
        const v = this.cell(r, key);
        if (key === "prompt") return h("td", { class: "text prompt", title: "show this prompt's responses across steps", onclick: () => this.samePrompt(r.ph) }, h("div", { text: v }));
        const link = key === "response" && this.source.value === "rollouts" ? tokensLink(this.run.value, r) : null;
        return kind === "num" ? h("td", { class: "num", text: fmt(v) }) : h("td", { class: "text" }, h("div", { text: v === null ? "" : v }), link);
      })));
      clear(this.table);
      this.table.append(h("table", { class: "rows" }, h("thead", {}, head), h("tbody", {}, ...body)));
      if (!ans.rows.length) this.table.append(h("p", { class: "muted", text: "No rows match." }));
      const end = this.offset + ans.rows.length;
      this.pageInfo.textContent = ans.rows.length ? "rows " + (this.offset + 1) + "–" + end + (ans.total !== null ? " of " + ans.total : " (searched " + ans.scanned + " rows; more may match)") : "";
      this.prev.disabled = this.offset === 0;
      this.next.disabled = ans.next === null;
      this.lastCount = this.summary ? this.summary.rows : 0;
    },
    async samePrompt(ph) {
      this.ph = ph; this.saveHash();
      let ans;
      try { ans = await api("rows", { run: this.run.value, source: this.source.value, ph: ph, sort: "step", limit: 200 }); } catch (e) {
        if (e instanceof ApiError) { this.error.textContent = e.message; return; }
        throw e;
      }
      const bySteps = new Map();
      for (const r of ans.rows) { if (!bySteps.has(r.step)) bySteps.set(r.step, []); bySteps.get(r.step).push(r); }
      clear(this.same);
      const prompt = ans.rows.length ? ans.rows[0].prompt : "";
      const close = h("button", { text: "close", onclick: () => { this.ph = ""; clear(this.same); this.saveHash(); } });
      this.same.append(h("div", { class: "same-prompt" }, h("div", {}, h("b", { text: "The same prompt across steps " }), close),
        h("pre", { class: "prompt", text: prompt }),
        h("div", { class: "cols" }, ...[...bySteps.entries()].map(([step, rows]) => h("div", { class: "col", "data-step": step },
          h("b", { text: "step " + step }), ...rows.map(r => h("div", { class: "resp" }, h("span", { class: "badge", text: "reward " + fmt(r.reward) }), " ", r.response)))))));
    },
    async poll() {
      const s = await this.steps(false);
      if (s && s.rows !== this.lastCount) await this.query();
    },
  };

  // ------------------------------------------------------------------ episodes
  const episodesView = {
    el: document.getElementById("view-episodes"), built: false, offset: 0,
    build() {
      const go = () => { this.offset = 0; this.saveHash(); this.query(); };
      [this.runLabel, this.run] = runSelect(() => { this.steps().then(go); });
      this.step = h("select", { onchange: go });
      this.status = h("select", { onchange: go });
      options(this.status, [["", "any status"], ["bad", "not ok"], ...STATUSES.map(s => [s, s])], "");
      this.q = h("input", { type: "search", placeholder: "text in any turn" });
      this.q.addEventListener("input", debounce(go, 300));
      this.info = h("span", { class: "muted" });
      this.error = h("div", { class: "error" });
      this.list = h("div");
      this.prev = h("button", { text: "previous", onclick: () => { this.offset = Math.max(0, this.offset - 20); this.saveHash(); this.query(); } });
      this.next = h("button", { text: "next", onclick: () => { if (this.nextOffset !== null) { this.offset = this.nextOffset; this.saveHash(); this.query(); } } });
      this.el.append(h("div", { class: "controls" }, this.runLabel, h("label", {}, "step", this.step), h("label", {}, "status", this.status),
        h("label", {}, "search", this.q), this.info), this.error, this.list, h("div", { class: "pager" }, this.prev, this.next));
      this.built = true;
    },
    params() { return { run: this.run.value, source: "rollouts", episodes: "1", step: this.step.value, status: this.status.value, q: this.q.value, offset: String(this.offset), limit: "20" }; },
    saveHash() {
      const p = this.params();
      writeHash("episodes", new URLSearchParams({ run: p.run === "0" ? "" : p.run, step: p.step === "all" ? "" : p.step, status: p.status, q: p.q, offset: this.offset ? p.offset : "" }));
    },
    async show(params) {
      if (!this.built) this.build();
      this.run.value = params.get("run") || "0";
      this.status.value = params.get("status") || ""; this.q.value = params.get("q") || ""; this.offset = Number(params.get("offset") || 0);
      await this.steps(params.get("step") || "all");
      await this.query();
    },
    async steps(step) {
      try {
        const s = await api("steps", { run: this.run.value, source: "rollouts" });
        options(this.step, [["all", "all steps"], ...s.steps.map(([k]) => [k, "step " + k])], step !== undefined ? step : this.step.value);
        this.info.textContent = s.episodes + " episodes in " + s.rows + " rollouts";
        this.count = s.rows;
        return s;
      } catch (e) { if (e instanceof ApiError) { this.error.textContent = e.message; return null; } throw e; }
    },
    async query() {
      this.error.textContent = "";
      let ans;
      try { ans = await api("rows", this.params()); } catch (e) { if (e instanceof ApiError) { this.error.textContent = e.message; return; } throw e; }
      this.nextOffset = ans.next;
      clear(this.list);
      if (!ans.rows.length) this.list.append(h("p", { class: "muted", text: "No episodes match (rollouts.jsonl rows with an episode)." }));
      for (const r of ans.rows) this.list.append(this.card(r));
      this.prev.disabled = this.offset === 0;
      this.next.disabled = ans.next === null;
      this.shown = this.count;
    },
    card(r) {
      const e = r.episode, bad = e.status !== "ok";
      const head = h("div", { class: "head" }, h("b", { text: "step " + r.step }), h("span", { text: "group " + r.group }),
        h("span", { class: "badge" + (bad ? " bad" : ""), text: e.status || "?" }), h("span", { text: "reward " + fmt(r.reward) }),
        h("span", { text: "advantage " + fmt(r.advantage) }), r.data_source ? h("span", { class: "muted", text: r.data_source }) : null,
        ...Object.entries(e.counts || {}).map(([k, v]) => h("span", { class: "muted", text: k + " " + fmt(v) })),
        e.error ? h("span", { class: "turn-error", text: "error: " + e.error }) : null, tokensLink(this.run.value, r));
      const turns = e.turns.map(t => h("div", { class: "turn " + (t.trained ? "trained" : "observation"), "data-role": t.role },
        h("span", { class: "role", text: t.role + (t.trained ? " (trained)" : "") }),
        t.reward !== null ? h("span", { class: "badge", text: "reward " + fmt(t.reward) }) : null,
        t.error ? h("span", { class: "turn-error", text: " error: " + t.error }) : null,
        h("div", { text: t.text })));
      return h("div", { class: "episode" + (bad ? " bad" : ""), "data-id": r.id, "data-status": e.status },
        head, h("details", {}, h("summary", { text: "prompt" }), h("pre", { class: "prompt", text: r.prompt })), ...turns);
    },
    async poll() { const s = await this.steps(); if (s && s.rows !== this.shown) await this.query(); },
  };

  // ------------------------------------------------------------------ tokens
  function minMax(vals) {
    let lo = Infinity, hi = -Infinity;
    for (const v of vals) if (v !== null) { if (v < lo) lo = v; if (v > hi) hi = v; }
    return [lo, hi];
  }
  function scaleFor(name, vals) {
    const [lo, hi] = minMax(vals);
    if (lo === Infinity) return { kind: "none" };
    const around = c => { let s = 0; for (const v of vals) if (v !== null) s = Math.max(s, Math.abs(v - c)); return s || 1; };
    if (/ratio|weight/i.test(name)) return { kind: "div", centre: 1, span: around(1) };
    if (/advantage|gap/i.test(name) || (lo < 0 && hi > 0)) return { kind: "div", centre: 0, span: around(0) };
    return { kind: "seq", lo: lo, hi: hi === lo ? lo + 1 : hi, reverse: /logprob/i.test(name) };
  }
  function tint(scale, v) {
    if (v === null || scale.kind === "none") return "";
    if (scale.kind === "div") {
      const t = Math.max(-1, Math.min(1, (v - scale.centre) / scale.span));
      return t < 0 ? "rgba(33,102,172," + (-0.85 * t).toFixed(3) + ")" : "rgba(214,39,40," + (0.85 * t).toFixed(3) + ")";
    }
    let t = (v - scale.lo) / (scale.hi - scale.lo);
    if (scale.reverse) t = 1 - t;
    return "rgba(255,140,0," + (0.05 + 0.8 * t).toFixed(3) + ")";
  }
  const tokensView = {
    el: document.getElementById("view-tokens"), built: false,
    build() {
      [this.runLabel, this.run] = runSelect(() => { this.load(undefined).then(() => this.pick()); });
      this.step = h("select", { onchange: () => { this.load(this.step.value).then(() => this.pick()); } });
      this.response = h("select", { onchange: () => this.pick() });
      this.value = h("select", { onchange: () => { this.saveHash(); this.paint(); } });
      this.legend = h("span", { class: "legend" });
      this.error = h("div", { class: "error" });
      this.info = h("span", { class: "muted" });
      this.body = h("div");
      this.el.append(h("div", { class: "controls" }, this.runLabel, h("label", {}, "step", this.step), h("label", {}, "response", this.response),
        h("label", {}, "colour by", this.value), this.legend, this.info), this.error, this.body);
      this.built = true;
    },
    saveHash() {
      writeHash("tokens", new URLSearchParams({ run: this.run.value === "0" ? "" : this.run.value, step: this.step.value, id: this.response.value, value: this.value.value }));
    },
    async show(params) {
      if (!this.built) this.build();
      this.run.value = params.get("run") || "0";
      this.wantValue = params.get("value") || "";
      this.wantSample = params.get("id") ? null : params.get("sample");
      await this.load(params.get("step") || undefined, params.get("id") || undefined);
      await this.pick();
    },
    async load(step, id) {
      this.error.textContent = "";
      let s;
      try { s = await api("tokens", { run: this.run.value, step: step === undefined ? "" : step }); } catch (e) {
        if (e instanceof ApiError) { this.error.textContent = e.message; return; }
        throw e;
      }
      this.count = s.rows;
      options(this.step, s.steps.map(([k, n]) => [k, "step " + k + " (" + n + ")"]), s.step);
      if (this.wantSample !== null && this.wantSample !== undefined) {  // from a rollout's link: its step and number
        const hit = s.responses.find(r => String(r.sample) === this.wantSample);
        if (hit) id = String(hit.id);
        else this.error.textContent = "step " + s.step + " has no token values for rollout sample " + this.wantSample + " (logging.token_samples records the first of each step's traced rollouts)";
        this.wantSample = null;
      }
      options(this.response, s.responses.map(r => [r.id, "#" + r.id + " " + r.group + ": " + r.prompt + " (" + r.n + " tokens)"]), id !== undefined ? id : this.response.value);
      const names = s.names.slice();
      const want = this.wantValue || this.value.value || (names.includes("logprob") ? "logprob" : names[0]);
      options(this.value, names.map(n => [n, n]), want);
      this.info.textContent = s.rows ? s.rows + " responses with token values" : "";
      problemNote("tokens" + this.run.value, runName(Number(this.run.value)) + " tokens.jsonl", s);
      if (!s.rows) { clear(this.body); this.body.append(h("p", { class: "muted", text: "No token values yet: tokens.jsonl is empty or missing." })); }
    },
    async pick() {
      if (!this.response.value) return;
      try { this.row = await api("token", { run: this.run.value, id: this.response.value }); } catch (e) {
        if (e instanceof ApiError) { this.error.textContent = e.message; return; }
        throw e;
      }
      const names = Object.keys(this.row.values);
      if (this.wantValue && names.includes(this.wantValue)) this.value.value = this.wantValue;
      this.wantValue = "";
      this.saveHash();
      this.paint();
    },
    paint() {
      const r = this.row;
      if (!r) return;
      const name = this.value.value, vals = r.values[name] || [];
      const scale = scaleFor(name, vals);
      clear(this.legend);
      if (scale.kind === "div") {
        this.legend.append(fmt(scale.centre - scale.span), h("span", { class: "bar", style: "background: linear-gradient(90deg, rgba(33,102,172,.85), #fff, rgba(214,39,40,.85))" }), fmt(scale.centre + scale.span), h("span", { class: "muted", text: " centred at " + scale.centre }));
      } else if (scale.kind === "seq") {
        const [a, b] = scale.reverse ? [scale.hi, scale.lo] : [scale.lo, scale.hi];
        this.legend.append(fmt(a), h("span", { class: "bar", style: "background: linear-gradient(90deg, rgba(255,140,0,.05), rgba(255,140,0,.85))" }), fmt(b));
      }
      this.legend.append(h("span", { class: "muted", text: " · grey: masked (not trained) · outlined: PPO ratio clipped" }));
      const all = Object.keys(r.values);
      const spans = r.tokens.map((t, i) => {
        const lines = ["token " + JSON.stringify(t) + " (#" + i + ")", ...all.map(n => n + ": " + (r.values[n][i] === null ? "–" : fmt(r.values[n][i])))];
        if (r.masked[i]) lines.push("masked (not trained)");
        if (r.clipped[i]) lines.push("clipped (PPO ratio)");
        const span = h("span", { class: "tok" + (r.masked[i] ? " masked" : "") + (r.clipped[i] ? " clipped" : ""), title: lines.join("\n"), "data-i": i },
          t.replace(/\n/g, "↵\n"));
        const bg = tint(scale, vals[i]);
        if (bg) span.style.background = bg;
        return span;
      });
      clear(this.body);
      this.body.append(h("div", { class: "muted", text: "step " + r.step + " · group " + r.group + " · " + r.tokens.length + " tokens" + (r.cut ? " (cut)" : "") }),
        h("pre", { class: "prompt", text: r.prompt }), h("div", { class: "tokens", "data-value": name }, ...spans));
    },
    async poll() {
      const before = this.count;
      const s = await api("tokens", { run: this.run.value, step: this.step.value });
      if (s.rows !== before) await this.load(this.step.value);
    },
  };

  // ------------------------------------------------------------------ routing and polling
  const IMPL = { metrics: metricsView, samples: samplesView, episodes: episodesView, tokens: tokensView };
  let busy = false;
  async function route() {
    const { view, params } = readHash();
    for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.view === view);
    for (const v of VIEWS) document.getElementById("view-" + v).hidden = v !== view;
    busy = true;
    try { await IMPL[view].show(params); } finally { busy = false; }
    document.body.dataset.ready = view;
  }
  async function poll() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      await IMPL[readHash().view].poll();
      setStatus("live · updated " + new Date().toLocaleTimeString());
    } catch (e) {
      if (e instanceof ApiError || e instanceof TypeError) setStatus("live · the server did not answer (" + e.message + ")");
      else throw e;
    } finally { busy = false; }
  }
  async function start() {
    for (const e of window.__verlEarlyErrors || []) window.__verlRecordError(e);
    RUNS = (await api("runs", {})).runs;
    const names = document.getElementById("run-names");
    for (const r of RUNS) names.append(h("span", { style: "color:" + colour(r.id), text: "■ " }), h("span", { title: r.path, text: r.name + "  " }));
    setStatus(LIVE ? "live" : "report (a snapshot; `verl view RUN_DIR` shows it live)");
    showNotes();
    window.addEventListener("hashchange", () => { route(); });
    for (const a of document.querySelectorAll("#tabs a")) {
      a.addEventListener("click", e => { e.preventDefault(); location.hash = lastHash[a.dataset.view] || "#" + a.dataset.view; });
    }
    await route();
    if (LIVE) setInterval(poll, POLL_MS);
  }
  start();
})();
