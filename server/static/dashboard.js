/* radixkv dashboard: polls /cache/stats and /cache/tree (live) or reads window.RADIXKV_DATA
 * (a static report). No dependencies; every piece of prompt text goes through textContent. */
(function () {
  "use strict";

  var DATA = window.RADIXKV_DATA;
  var STATIC = !!DATA;
  var STATS_MS = 1000;
  var WINDOW = 10; // samples in the rolling hit-rate window
  var ROW_H = 40;
  var MAX_ROWS = 12;

  var state = {
    history: [],
    lastSeq: null,
    stats: null,
    tree: null,
    zoom: 0,
    selected: null,
    hovered: null,
    paused: false,
    maxNodes: 300,
    treeMs: 0,
    nextTreeAt: 0,
    asked: false,
  };

  function $(id) { return document.getElementById(id); }

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function fmt(n) {
    if (n === null || n === undefined || isNaN(n)) return "–";
    var a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return String(Math.round(n));
  }

  function pct(x) { return x === null || isNaN(x) ? "–" : (100 * x).toFixed(1) + "%"; }

  function bytes(n) {
    if (!n) return "0 B";
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + " " + u[i];
  }

  function setStatus(text, cls) {
    var s = $("status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }

  // ------------------------------------------------------------------ auth + fetch
  var key = null;
  if (!STATIC) {
    // the key comes in the URL fragment (#key=...), which browsers never send to the server
    var frag = new URLSearchParams(location.hash.replace(/^#/, ""));
    if (frag.get("key")) {
      key = frag.get("key");
      try { sessionStorage.setItem("radixkv-key", key); } catch (e) { /* private mode */ }
      // keep the key out of the address bar and the history
      history.replaceState(null, "", location.pathname + location.search);
    } else {
      try { key = sessionStorage.getItem("radixkv-key"); } catch (e) { key = null; }
    }
  }

  function api(path) {
    var headers = key ? { Authorization: "Bearer " + key } : {};
    return fetch(path, { headers: headers, cache: "no-store" }).then(function (r) {
      if (r.status === 401 || r.status === 403) {
        if (!state.asked) {
          state.asked = true;
          var k = window.prompt("Admin key of this radixkv server");
          if (k) {
            key = k;
            state.asked = false;
            try { sessionStorage.setItem("radixkv-key", k); } catch (e) { /* ignore */ }
          }
        }
        throw new Error("unauthorized: the API key is missing or wrong");
      }
      if (!r.ok) throw new Error(path.split("?")[0] + ": HTTP " + r.status);
      return r.json();
    });
  }

  // ------------------------------------------------------------------ KPIs
  function setKpi(id, value, text, sub) {
    var box = $(id);
    var v = box.querySelector(".value");
    v.textContent = text;
    v.setAttribute("data-value", String(value));
    if (sub !== undefined) box.querySelector(".sub").textContent = sub;
  }

  function latest() { return state.history.length ? state.history[state.history.length - 1] : null; }

  function renderKpis() {
    var s = latest();
    var st = state.stats || {};
    if (!s) return;
    var th = s.prompt_tokens ? s.cached_tokens / s.prompt_tokens : 0;
    var rh = s.requests ? s.requests_hit / s.requests : 0;
    setKpi("kpi-token-hit", th, pct(th), fmt(s.cached_tokens) + " of " + fmt(s.prompt_tokens) + " prompt tokens");
    setKpi("kpi-request-hit", rh, pct(rh), fmt(s.requests_hit) + " of " + fmt(s.requests) + " requests");
    if (STATIC) {
      setKpi("kpi-requests", s.requests, fmt(s.requests), "requests replayed");
      $("kpi-requests").querySelector(".label").textContent = "Requests";
    } else {
      setKpi("kpi-requests", s.running + s.waiting, s.running + " / " + s.waiting,
        fmt(st.preemptions_total || 0) + " preemptions · " + fmt(st.steps_total || 0) + " steps");
    }
    var ev = s.evicted_tokens || {};
    setKpi("kpi-evicted", ev.device || 0, fmt(ev.device || 0),
      ev.host ? fmt(ev.host) + " more dropped from the host tier" : "from the device tier");
    var loads = s.loads || {}, lp = s.load_pages || {};
    var nl = (loads.host || 0) + (loads.disk || 0) + (loads.remote || 0);
    var parts = [];
    ["host", "disk", "remote"].forEach(function (t) {
      if (loads[t]) parts.push(t + " " + fmt(loads[t]) + " (" + fmt(lp[t] || 0) + " pages)");
    });
    setKpi("kpi-loads", nl, fmt(nl), parts.join(" · ") || "host, disk and remote admissions");
  }

  // ------------------------------------------------------------------ chart
  function series() {
    var h = state.history, out = { token: [], request: [], cumulative: [] };
    for (var i = 0; i < h.length; i++) {
      var s = h[i], x = STATIC ? s.requests : s.t;
      var j = Math.max(0, i - WINDOW), p = h[j];
      var dp = s.prompt_tokens - (i > 0 ? p.prompt_tokens : 0);
      var dc = s.cached_tokens - (i > 0 ? p.cached_tokens : 0);
      var dr = s.requests - (i > 0 ? p.requests : 0);
      var dh = s.requests_hit - (i > 0 ? p.requests_hit : 0);
      out.token.push([x, dp > 0 ? dc / dp : null]);
      out.request.push([x, dr > 0 ? dh / dr : null]);
      out.cumulative.push([x, s.prompt_tokens ? s.cached_tokens / s.prompt_tokens : null]);
    }
    return out;
  }

  function svgEl(tag, attrs) {
    var e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }

  // offsets 0, step, 2 step, ... within span, step a round number giving at most 6 ticks:
  // seconds (live) or 1-2-5 multiples of a power of ten (requests, static)
  function niceTicks(span, isCount) {
    var step = null, i;
    if (!isCount) {
      var secs = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600];
      for (i = 0; i < secs.length && step === null; i++) if (span / secs[i] <= 5) step = secs[i];
    }
    if (step === null) {
      var p = Math.pow(10, Math.floor(Math.log10(Math.max(1, span) / 5)));
      step = [1, 2, 5, 10].map(function (m) { return m * p; }).filter(function (v) { return span / v <= 5; })[0];
    }
    var out = [];
    for (var d = 0; d <= span + 1e-9; d += step) out.push(d);
    return out;
  }

  function renderChart() {
    var svg = $("chart");
    var W = svg.clientWidth || 600, H = svg.clientHeight || 200;
    var L = 40, R = 10, T = 10, B = 24;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var s = series();
    var xs = s.cumulative.map(function (p) { return p[0]; });
    if (xs.length < 2) {
      var t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", "class": "empty" });
      t.textContent = "waiting for samples…";
      svg.appendChild(t);
      return;
    }
    var x0 = xs[0], x1 = xs[xs.length - 1];
    if (!STATIC) x0 = Math.max(x0, x1 - 300);
    if (x1 === x0) x1 = x0 + 1;
    function X(x) { return L + (W - L - R) * (x - x0) / (x1 - x0); }
    function Y(y) { return T + (H - T - B) * (1 - y); }
    [0, 0.25, 0.5, 0.75, 1].forEach(function (y) {
      svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: Y(y), y2: Y(y), "class": "grid" }));
      var lab = svgEl("text", { x: L - 6, y: Y(y) + 4, "text-anchor": "end", "class": "axis" });
      lab.textContent = (y * 100) + "%";
      svg.appendChild(lab);
    });
    niceTicks(x1 - x0, STATIC).forEach(function (d, i, all) {
      var step = all.length > 1 ? all[1] : 1;
      var xv = STATIC ? Math.ceil(x0 / step) * step + d : x1 - d;
      if (xv < x0 - 1e-9 || xv > x1 + 1e-9) return;
      var tl = svgEl("text", { x: X(xv), y: H - 6, "text-anchor": "middle", "class": "axis" });
      if (STATIC) tl.textContent = fmt(xv);
      else tl.textContent = d === 0 ? "now" : d >= 120 ? "-" + Math.round(d / 60) + "m" : "-" + d + "s";
      svg.appendChild(tl);
    });
    ["cumulative", "request", "token"].forEach(function (name) {
      var d = "", pen = false;
      s[name].forEach(function (p) {
        if (p[0] < x0 || p[1] === null) { pen = false; return; }
        d += (pen ? "L" : "M") + X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1);
        pen = true;
      });
      if (d) svg.appendChild(svgEl("path", { d: d, "class": name }));
    });
    $("chart-note").textContent = STATIC
      ? "x: requests replayed; rolling window of " + WINDOW + " samples"
      : "last " + Math.round(x1 - x0) + " s, rolling " + WINDOW + " s window";
  }

  // ------------------------------------------------------------------ tiers
  function tierRow(name, used, cap, extraFill, facts, fillCls) {
    var row = el("div", "tier");
    var head = el("div", "head");
    head.appendChild(el("span", "name", name));
    head.appendChild(el("span", "nums", used.text + " / " + cap.text + (cap.value ? " (" + pct(used.value / cap.value) + ")" : "")));
    row.appendChild(head);
    var bar = el("div", "bar");
    if (extraFill) {
      var f2 = el("div", "fill cached");
      f2.style.width = (cap.value ? 100 * Math.min(1, extraFill / cap.value) : 0) + "%";
      bar.appendChild(f2);
    }
    var f = el("div", "fill " + (fillCls || ""));
    f.style.width = (cap.value ? 100 * Math.min(1, used.value / cap.value) : 0) + "%";
    bar.appendChild(f);
    row.appendChild(bar);
    var fx = el("div", "facts");
    facts.forEach(function (kv) {
      var span = el("span", null, kv[0] + " ");
      span.appendChild(el("b", null, kv[1]));
      fx.appendChild(span);
    });
    row.appendChild(fx);
    return row;
  }

  function renderTiers() {
    var s = latest(), box = $("tiers");
    if (!s) return;
    while (box.firstChild) box.removeChild(box.firstChild);
    var t = s.tiers || {}, hits = s.cached_by_tier || {}, loads = s.loads || {}, lp = s.load_pages || {};
    var ev = s.evicted_tokens || {};
    if (t.device) {
      var d = t.device, inUse = Math.max(0, d.used - d.cached);
      box.appendChild(tierRow("device",
        { value: d.used, text: fmt(d.used) + " tok" }, { value: d.capacity, text: fmt(d.capacity) },
        d.used, [["cached prefixes", fmt(d.cached)], ["in running requests", fmt(inUse)],
          ["hits", fmt(hits.device || 0) + " tok"], ["evicted", fmt(ev.device || 0) + " tok"],
          ["KV dtype", (d.kv_dtype || "?") + (d.bytes_per_token ? " (" + bytes(d.bytes_per_token) + "/tok)" : "")]],
        "cached"));
    }
    if (t.host) {
      box.appendChild(tierRow("host",
        { value: t.host.used, text: fmt(t.host.used) + " tok" }, { value: t.host.capacity, text: fmt(t.host.capacity) },
        0, [["hits", fmt(hits.host || 0) + " tok"], ["loads", fmt(loads.host || 0) + " (" + fmt(lp.host || 0) + " pages)"],
          ["evicted", fmt(ev.host || 0) + " tok"]], "host"));
    }
    if (t.disk) {
      box.appendChild(tierRow("disk",
        { value: t.disk.used_bytes, text: bytes(t.disk.used_bytes) }, { value: t.disk.capacity_bytes, text: bytes(t.disk.capacity_bytes) },
        0, [["files", fmt(t.disk.files)], ["hits", fmt(hits.disk || 0) + " tok"],
          ["holds", t.device && t.device.bytes_per_token
            ? "~" + fmt(Math.floor(t.disk.capacity_bytes / t.device.bytes_per_token)) + " tok" : "?"],
          ["loads", fmt(loads.disk || 0) + " (" + fmt(lp.disk || 0) + " pages)"]], "disk"));
    }
    if (t.remote) {
      var r = t.remote, pages = r.pages !== undefined ? r.pages : r.writes || 0;
      box.appendChild(tierRow("remote",
        { value: 0, text: fmt(pages) + " pages" }, { value: 0, text: r.available === false ? "down" : "shared" },
        0, [["hits", fmt(hits.remote || 0) + " tok"], ["loads", fmt(loads.remote || 0) + " (" + fmt(lp.remote || 0) + " pages)"]],
        "remote"));
    }
    if (!box.firstChild) box.appendChild(el("p", "hint", "no tier data yet"));
  }

  // ------------------------------------------------------------------ tree
  function indexTree(doc) {
    var byId = {}, kids = {};
    doc.nodes.forEach(function (n) {
      byId[n.id] = n;
      kids[n.id] = [];
    });
    doc.nodes.forEach(function (n) {
      if (n.parent !== null && kids[n.parent]) kids[n.parent].push(n);
    });
    Object.keys(kids).forEach(function (k) {
      kids[k].sort(function (a, b) {
        if ((a.kind === "more") !== (b.kind === "more")) return a.kind === "more" ? 1 : -1;
        return b.subtree_tokens - a.subtree_tokens;
      });
    });
    return { byId: byId, kids: kids };
  }

  function oneLine(text) { return text.replace(/\s*\n\s*/g, " ⏎ ").replace(/\s+/g, " "); }

  function nodeLabel(n) {
    if (n.kind === "root") return "all cached prefixes";
    if (n.kind === "namespace") return "salt #" + n.namespace;
    if (n.kind === "more") return "+" + fmt(n.subtree_nodes) + " more nodes";
    if (n.text === null) return "(text hidden)";
    return oneLine(n.text);
  }

  function nodeMeta(n) {
    if (n.kind === "root") return fmt(n.subtree_tokens) + " tokens in " + fmt(n.subtree_nodes - 1) + " nodes";
    if (n.kind === "more") return fmt(n.tokens) + " tok in " + n.children + " subtrees";
    var m = fmt(n.tokens) + " tok";
    if (n.hit_count) m += " · " + fmt(n.hit_count) + (n.hit_count === 1 ? " hit" : " hits");
    if (n.children) m += " · " + n.children + (n.children === 1 ? " child" : " children");
    return m;
  }

  function residencyLetters(r) {
    return (r.device ? "D" : "") + (r.host ? "H" : "") + (r.disk ? "S" : "") + (r.remote ? "R" : "");
  }

  function renderTree() {
    var doc = state.tree, box = $("icicle");
    if (!doc) return;
    var ix = indexTree(doc);
    if (!ix.byId[state.zoom]) state.zoom = 0;
    var top = ix.byId[state.zoom];
    var hidden = doc.text === "hide" ? " · text hidden" : "";
    $("tree-summary").textContent = fmt(doc.total_nodes) + " nodes, " + fmt(doc.total_tokens) +
      " tokens (" + fmt(doc.device_tokens) + " on device, " + fmt(doc.host_tokens) + " on host); showing " +
      doc.shown_nodes + hidden;
    // breadcrumbs
    var crumbs = $("crumbs");
    while (crumbs.firstChild) crumbs.removeChild(crumbs.firstChild);
    var path = [], n = top;
    while (n) { path.unshift(n); n = n.parent === null ? null : ix.byId[n.parent]; }
    path.forEach(function (p, i) {
      if (i) crumbs.appendChild(document.createTextNode(" › "));
      var a = el("a", null, i ? (p.kind === "namespace" ? "salt #" + p.namespace : fmt(p.prefix_tokens) + " tok") : "root");
      a.addEventListener("click", function () { state.zoom = p.id; renderTree(); });
      crumbs.appendChild(a);
    });
    // layout: rows by depth below the zoomed node, widths by subtree tokens among siblings
    var W = box.clientWidth || 900;
    var maxHits = 1;
    doc.nodes.forEach(function (x) { if (x.kind !== "more" && x.hit_count > maxHits) maxHits = x.hit_count; });
    var frag = document.createDocumentFragment();
    var rows = 0;
    function place(node, x, w, depth) {
      if (w < 2 || depth >= MAX_ROWS) return;
      rows = Math.max(rows, depth + 1);
      frag.appendChild(drawNode(node, x, w, depth, maxHits));
      var kids = ix.kids[node.id] || [];
      var total = 0;
      kids.forEach(function (k) { total += Math.max(1, k.subtree_tokens); });
      var at = x;
      kids.forEach(function (k) {
        var kw = total ? w * Math.max(1, k.subtree_tokens) / total : 0;
        place(k, at, kw, depth + 1);
        at += kw;
      });
    }
    place(top, 0, W, 0);
    while (box.firstChild) box.removeChild(box.firstChild);
    box.style.height = (rows * ROW_H + 4) + "px";
    box.appendChild(frag);
    renderDetail();
  }

  function drawNode(n, x, w, depth, maxHits) {
    var d = el("div", "node " + n.kind);
    if (n.kind === "node" && !n.residency.device && n.residency.host) d.classList.add("host");
    if (n.lock_ref > 0 && n.kind !== "root") d.classList.add("locked");
    if (w < 70) d.classList.add("narrow");
    if (w < 48) d.classList.add("tiny");
    if (state.selected === n.id) d.classList.add("selected");
    if (n.kind === "node" && n.residency.device) {
      var heat = Math.log(1 + n.hit_count) / Math.log(1 + maxHits);
      d.style.background = "rgba(var(--device), " + (0.1 + 0.4 * heat).toFixed(3) + ")";
    }
    d.style.left = (x + 1).toFixed(1) + "px";
    d.style.width = Math.max(1, w - 2).toFixed(1) + "px";
    d.style.top = (depth * ROW_H + 2) + "px";
    d.style.height = (ROW_H - 4) + "px";
    d.setAttribute("data-id", n.id);
    d.setAttribute("data-kind", n.kind);
    d.setAttribute("data-tokens", n.tokens);
    d.setAttribute("data-prefix-tokens", n.prefix_tokens);
    d.setAttribute("data-hits", n.hit_count);
    d.appendChild(el("span", "snip", nodeLabel(n)));
    var meta = el("span", "meta", nodeMeta(n));
    if (n.kind === "node" || n.kind === "namespace") {
      var res = residencyLetters(n.residency);
      if (res) meta.appendChild(el("b", "badge", res));
      if (n.lock_ref > 0) meta.appendChild(el("b", "badge lock", "L" + n.lock_ref));
      if (n.pinned) meta.appendChild(el("b", "badge pin", "PIN"));
    }
    d.appendChild(meta);
    d.title = nodeLabel(n) + "\n" + nodeMeta(n);
    d.addEventListener("mouseenter", function () { state.hovered = n.id; renderDetail(); });
    d.addEventListener("mouseleave", function () { state.hovered = null; renderDetail(); });
    d.addEventListener("click", function () {
      state.selected = n.id;
      if (n.id === state.zoom && n.parent !== null) state.zoom = n.parent; // top row: zoom out
      else if (n.kind !== "more" && n.children > 0 && depth > 0) state.zoom = n.id; // zoom in
      renderTree();
    });
    return d;
  }

  // the node shown in the details before anything is picked: the most hit one
  function hottest(doc) {
    var best = null;
    doc.nodes.forEach(function (n) {
      if (n.kind === "node" && (!best || n.hit_count > best.hit_count)) best = n;
    });
    return best ? best.id : null;
  }

  function renderDetail() {
    var box = $("detail"), doc = state.tree;
    if (!doc) return;
    var id = state.hovered !== null ? state.hovered : state.selected;
    if (id === null) id = hottest(doc);
    var n = null;
    for (var i = 0; i < doc.nodes.length; i++) if (doc.nodes[i].id === id) n = doc.nodes[i];
    while (box.firstChild) box.removeChild(box.firstChild);
    if (!n) {
      box.appendChild(el("p", "hint", "Hover a node for its details; click to zoom in, click the top row to zoom out."));
      return;
    }
    box.appendChild(el("h3", null, n.kind === "node" ? "Node " + n.id : n.kind === "more" ? "Folded nodes" : n.kind === "namespace" ? "Salted namespace" : "Root"));
    var dl = el("dl");
    function row(k, v) { dl.appendChild(el("dt", null, k)); var dd = el("dd"); if (v instanceof Node) dd.appendChild(v); else dd.textContent = v; dl.appendChild(dd); }
    if (n.kind === "more") {
      row("nodes", fmt(n.subtree_nodes));
      row("tokens", fmt(n.tokens));
      row("subtrees", n.children);
    } else {
      row("edge tokens", fmt(n.tokens));
      row("prefix length", fmt(n.prefix_tokens) + " tok");
      row("subtree", fmt(n.subtree_tokens) + " tok in " + fmt(n.subtree_nodes) + " nodes");
      row("children", n.children);
    }
    row("lock refs", n.lock_ref);
    if (n.kind !== "root") {
      row("hit count", fmt(n.hit_count));
      row("last access", "tick " + n.last_access + " (" + fmt(Math.max(0, doc.tick - n.last_access)) + " ops ago)");
    }
    if (n.kind === "node" || n.kind === "more") {
      var chips = el("span");
      ["device", "host", "disk", "remote"].forEach(function (t) {
        chips.appendChild(el("span", "chip" + (n.residency[t] ? " on" : ""), t));
      });
      row("residency", chips);
    }
    if (n.pinned) row("pinned", "yes");
    if (n.namespace) row("salt", "#" + n.namespace);
    box.appendChild(dl);
    if (n.kind === "node") {
      box.appendChild(el("pre", null, n.text === null ? "(text hidden: --dashboard-text hide)" : n.text));
    }
  }

  // ------------------------------------------------------------------ polling
  function pollStats() {
    var q = "cache/stats?history=true" + (state.lastSeq !== null ? "&since=" + state.lastSeq : "");
    return api(q).then(function (st) {
      var h = st.history || [];
      delete st.history;
      state.stats = st;
      if (h.length) {
        if (state.lastSeq !== null && h[0].seq !== state.lastSeq + 1) state.history = []; // server restarted
        state.history = state.history.concat(h).slice(-600);
        state.lastSeq = h[h.length - 1].seq;
      }
      if (st.model) $("model").textContent = st.model;
      renderKpis();
      renderChart();
      renderTiers();
    });
  }

  function pollTree() {
    var t0 = performance.now();
    return api("cache/tree?max_nodes=" + state.maxNodes).then(function (doc) {
      state.treeMs = performance.now() - t0;
      state.tree = doc;
      renderTree();
    });
  }

  function tick() {
    if (state.paused) { setTimeout(tick, STATS_MS); return; }
    var jobs = [pollStats()];
    var now = performance.now();
    if (now >= state.nextTreeAt) {
      jobs.push(pollTree().then(function () {
        // a big tree costs the engine thread: poll it less often when it is slow
        state.nextTreeAt = performance.now() + Math.max(STATS_MS, 8 * state.treeMs) - 50;
      }));
    }
    Promise.all(jobs).then(function () {
      setStatus("live · " + new Date().toLocaleTimeString(), "live");
    }).catch(function (err) {
      setStatus(err.message || String(err), "error");
    }).then(function () { setTimeout(tick, STATS_MS); });
  }

  // ------------------------------------------------------------------ start
  $("max-nodes").addEventListener("change", function (e) {
    state.maxNodes = parseInt(e.target.value, 10) || 300;
    state.nextTreeAt = 0;
  });
  $("pause").addEventListener("click", function () {
    state.paused = !state.paused;
    $("pause").textContent = state.paused ? "Resume" : "Pause";
    if (state.paused) setStatus("paused", "paused");
  });
  window.addEventListener("resize", function () { renderChart(); renderTree(); });

  if (STATIC) {
    state.history = DATA.history || [];
    state.stats = DATA.stats || {};
    state.tree = DATA.tree || null;
    document.title = DATA.title || "radixkv report";
    $("model").textContent = DATA.title || "";
    setStatus("static report", "static");
    $("nodes-control").style.display = "none";
    $("pause").style.display = "none";
    renderKpis();
    renderChart();
    renderTiers();
    renderTree();
  } else {
    tick();
  }
})();
