// pagedkv visualizer: decodes the runs embedded by pagedkv.viz.page (format: pagedkv/viz/encode.py)
// and draws one step of one run. Everything is precomputed, so the page works from a file:// URL.
(function () {
  "use strict";

  // The runs are embedded as JSON, or (the default) gzip-compressed JSON in base64: several MB of
  // frames become about one. The browser's own DecompressionStream inflates them, still offline.
  async function loadData() {
    const node = document.getElementById("viz-data");
    const encoding = node.dataset.encoding || "json";
    const text = node.textContent.trim();
    if (encoding === "json") return JSON.parse(text);
    if (encoding !== "gzip+base64") throw new Error("unknown data encoding " + encoding);
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot inflate the embedded runs (no DecompressionStream); " +
        "use a current Chrome, Edge, Firefox or Safari, or write the page with pagedkv viz --no-compress");
    }
    const binary = atob(text);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return JSON.parse(await new Response(stream).text());
  }

  function showLoadError(error) {
    const line = document.getElementById("workload-line");
    line.setAttribute("role", "alert");
    line.textContent = "Could not load the recorded runs: " + (error && error.message ? error.message : error);
    document.body.dataset.ready = "error";
  }

  loadData().then(start, showLoadError);

  function start(DATA) {
  // Slots per grid row: a multiple of every block size offered (1..32), so blocks never wrap.
  const SLOTS_PER_ROW = 64;
  const SPEEDS = [1, 2, 5, 10, 20, 40]; // steps per second
  const DEFAULT_SPEED_INDEX = 3;
  const MAX_CHIPS_PER_TABLE = 12;
  const DECODED_CACHE_SIZE = 4;

  const $ = (id) => document.getElementById(id);
  const el = {
    allocator: $("sel-allocator"), blockSize: $("sel-block-size"), seed: $("sel-seed"),
    speed: $("sel-speed"), reset: $("btn-reset"), back: $("btn-back"), play: $("btn-play"),
    step: $("btn-step"), range: $("rng-step"), out: $("out-step"),
    pool: $("pool-canvas"), poolCaption: $("pool-caption"), cellInfo: $("cell-info"),
    chart: $("chart-canvas"), tables: $("tables-list"), tablesCount: $("tables-count"),
    compare: $("compare-line"), announce: $("announce"), workloadLine: $("workload-line"),
    c: {
      step: $("c-step"), running: $("c-running"), waiting: $("c-waiting"), finished: $("c-finished"),
      blocks: $("c-blocks"), waste: $("c-waste"), preemptions: $("c-preemptions"),
    },
    seg: { token: $("seg-token"), reserved: $("seg-reserved"), frag: $("seg-frag"), ext: $("seg-ext"), free: $("seg-free") },
    f: { token: $("f-token"), reserved: $("f-reserved"), frag: $("f-frag"), ext: $("f-ext"), free: $("f-free") },
    fExtItem: $("f-ext-item"),
    fragBar: $("frag-bar"),
  };

  // ---- the runs ------------------------------------------------------------------------------
  const runKey = (allocator, blockSize, seed) => allocator + "|" + blockSize + "|" + seed;
  const runs = new Map();
  for (const run of DATA.runs) runs.set(runKey(run.allocator, run.block_size, run.seed), run);
  const uniq = (xs) => Array.from(new Set(xs));
  const allocators = uniq(DATA.runs.map((r) => r.allocator));
  const blockSizes = uniq(DATA.runs.map((r) => r.block_size)).sort((a, b) => a - b);
  const seeds = uniq(DATA.runs.map((r) => r.seed)).sort((a, b) => a - b);

  // Decoded runs: {pools: Int32Array [n * num_blocks * 3], tables: per frame [{rid, sample, ntok,
  // blocks}] (one entry per sequence; sample = index in the request's group), shared: per frame
  // Map block id -> refcount of copy-on-write shared blocks}.
  const decoded = new Map();
  function decodeRun(run) {
    const key = runKey(run.allocator, run.block_size, run.seed);
    if (decoded.has(key)) {
      const hit = decoded.get(key);
      decoded.delete(key);
      decoded.set(key, hit); // most recently used last
      return hit;
    }
    const nb = run.num_blocks;
    const width = nb * 3;
    const pools = new Int32Array(run.n * width);
    const cur = new Int32Array(width);
    for (let i = 0; i < nb; i++) cur[i * 3] = -1;
    const tables = new Array(run.n);
    const shared = new Array(run.n);
    const seqKey = (rid, sample) => rid + "/" + sample;
    let prev = new Map(); // "rid/sample" -> {rid, sample, ntok, blocks}
    let sharedNow = new Map();
    for (let f = 0; f < run.n; f++) {
      const sets = run.p[f];
      let cell = -1;
      for (let k = 0; k < sets.length; k += 4) {
        cell += sets[k];
        cur[cell * 3] = sets[k + 1];
        cur[cell * 3 + 1] = sets[k + 2];
        cur[cell * 3 + 2] = sets[k + 3];
      }
      cell = -1;
      for (const gap of run.pi[f]) {
        cell += gap;
        cur[cell * 3 + 1] += 1;
        cur[cell * 3 + 2] -= 1;
      }
      pools.set(cur, f * width);

      const gone = new Set();
      for (let k = 0; k < run.tg[f].length; k += 2) gone.add(seqKey(run.tg[f][k], run.tg[f][k + 1]));
      const delta = run.td[f];
      const next = new Map();
      for (const [key, e] of prev) {
        if (!gone.has(key)) next.set(key, delta === 0 ? e : { rid: e.rid, sample: e.sample, ntok: e.ntok + delta, blocks: e.blocks });
      }
      const changes = run.t[f];
      for (let k = 0; k < changes.length;) {
        const rid = changes[k], sample = changes[k + 1], ntok = changes[k + 2], kept = changes[k + 3], added = changes[k + 4];
        const key = seqKey(rid, sample);
        const old = kept > 0 ? next.get(key).blocks.slice(0, kept) : [];
        for (let j = 0; j < added; j++) old.push(changes[k + 5 + j]);
        next.set(key, { rid, sample, ntok, blocks: old });
        k += 5 + added;
      }
      tables[f] = Array.from(next.values()).sort((a, b) => a.rid - b.rid || a.sample - b.sample);
      prev = next;
      const sh = run.sh ? run.sh[f] : [];
      if (sh !== null) {
        sharedNow = new Map();
        for (let k = 0; k < sh.length; k += 2) sharedNow.set(sh[k], sh[k + 1]);
      }
      shared[f] = sharedNow;
    }
    const result = { pools, tables, shared };
    decoded.set(key, result);
    while (decoded.size > DECODED_CACHE_SIZE) decoded.delete(decoded.keys().next().value);
    return result;
  }

  // ---- state ---------------------------------------------------------------------------------
  const initial = DATA.initial || {};
  const state = {
    allocator: allocators.includes(initial.allocator) ? initial.allocator : allocators[0],
    blockSize: blockSizes.includes(initial.block_size) ? initial.block_size
      : (blockSizes.includes(16) ? 16 : blockSizes[0]),
    seed: seeds.includes(initial.seed) ? initial.seed : seeds[0],
    frame: 0,
    playing: false,
    speedIndex: DEFAULT_SPEED_INDEX,
    selectedRid: null,
    hoverCell: -1,
  };

  function currentRun() {
    return runs.get(runKey(state.allocator, state.blockSize, state.seed)) || null;
  }

  // ---- colours -------------------------------------------------------------------------------
  // Golden-angle hues: neighbouring request ids get clearly different colours.
  const hue = (rid) => Math.round((rid * 137.508) % 360);
  // Three lightness steps on top of the hues keep neighbours apart even when hues come close.
  const LIGHTNESS = [44, 34, 54];
  const tokenColor = (rid) => "hsl(" + hue(rid) + ",62%," + LIGHTNESS[rid % 3] + "%)";
  const reservedColor = (rid) => "hsl(" + hue(rid) + ",70%,84%)";
  const FREE_COLOR = "#dfe3ea";
  const FRAG_COLOR = "#e0812a";

  // ---- formatting ----------------------------------------------------------------------------
  const fmtInt = (n) => String(n);
  const fmtPct = (x) => x.toFixed(1) + " %";
  const pctOf = (part, whole) => (whole > 0 ? (100 * part) / whole : 0);

  // ---- controls ------------------------------------------------------------------------------
  function fillSelect(select, values, label) {
    select.innerHTML = "";
    for (const v of values) {
      const o = document.createElement("option");
      o.value = String(v);
      o.textContent = label(v);
      select.appendChild(o);
    }
  }
  fillSelect(el.allocator, allocators, (a) => a);
  fillSelect(el.blockSize, blockSizes, (b) => b + (b === 1 ? " token" : " tokens"));
  fillSelect(el.seed, seeds, (s) => "seed " + s);
  fillSelect(el.speed, SPEEDS.map((_, i) => i), (i) => SPEEDS[i] + " steps/s");

  function syncControls() {
    el.allocator.value = state.allocator;
    el.blockSize.value = String(state.blockSize);
    el.seed.value = String(state.seed);
    el.speed.value = String(state.speedIndex);
    const run = currentRun();
    const n = run ? run.n : 1;
    el.range.max = String(n - 1);
    el.range.value = String(state.frame);
    el.out.textContent = state.frame + " / " + (n - 1);
    el.play.setAttribute("aria-pressed", state.playing ? "true" : "false");
    el.play.setAttribute("aria-label", (state.playing ? "Pause" : "Play") + " (shortcut Space)");
    el.play.innerHTML = state.playing ? "&#x275A;&#x275A; Pause" : "&#x25B6;&#xFE0E; Play";
  }

  function setRun(allocator, blockSize, seed) {
    state.allocator = allocator;
    state.blockSize = blockSize;
    state.seed = seed;
    const run = currentRun();
    if (run) state.frame = Math.min(state.frame, run.n - 1);
    state.selectedRid = null;
    render();
  }

  function setFrame(frame, announce) {
    const run = currentRun();
    if (!run) return;
    state.frame = Math.max(0, Math.min(run.n - 1, frame));
    render();
    if (announce) {
      const c = run.c;
      el.announce.textContent = "Step " + c.step[state.frame] + ": " + c.running[state.frame] +
        " running, waste " + fmtPct(c.waste_pct[state.frame]);
    }
  }

  const cycle = (values, current, by) => values[(values.indexOf(current) + by + values.length) % values.length];

  // ---- playback ------------------------------------------------------------------------------
  let lastTick = 0;
  let carried = 0;
  function tick(now) {
    if (!state.playing) return;
    const run = currentRun();
    if (!run) return;
    carried += ((now - lastTick) / 1000) * SPEEDS[state.speedIndex];
    lastTick = now;
    const whole = Math.floor(carried);
    if (whole > 0) {
      carried -= whole;
      const target = state.frame + whole;
      if (target >= run.n - 1) {
        state.frame = run.n - 1;
        state.playing = false;
      } else {
        state.frame = target;
      }
      render();
    }
    if (state.playing) requestAnimationFrame(tick);
  }
  function setPlaying(on) {
    const run = currentRun();
    if (on && run && state.frame >= run.n - 1) state.frame = 0; // play again from the start
    state.playing = on;
    if (on) {
      lastTick = performance.now();
      carried = 0;
      requestAnimationFrame(tick);
    }
    render();
  }

  el.allocator.addEventListener("change", () => setRun(el.allocator.value, state.blockSize, state.seed));
  el.blockSize.addEventListener("change", () => setRun(state.allocator, Number(el.blockSize.value), state.seed));
  el.seed.addEventListener("change", () => setRun(state.allocator, state.blockSize, Number(el.seed.value)));
  el.speed.addEventListener("change", () => { state.speedIndex = Number(el.speed.value); syncControls(); });
  el.range.addEventListener("input", () => setFrame(Number(el.range.value), false));
  el.reset.addEventListener("click", () => { state.playing = false; setFrame(0, true); });
  el.back.addEventListener("click", () => { state.playing = false; setFrame(state.frame - 1, true); });
  el.step.addEventListener("click", () => { state.playing = false; setFrame(state.frame + 1, true); });
  el.play.addEventListener("click", () => setPlaying(!state.playing));

  document.addEventListener("keydown", (ev) => {
    if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const tag = ev.target && ev.target.tagName;
    const inField = tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA";
    const onButton = tag === "BUTTON";
    const by = ev.shiftKey ? 10 : 1;
    let handled = true;
    switch (ev.key) {
      case " ":
        if (inField || onButton) { handled = false; break; }
        setPlaying(!state.playing); break;
      case "k": setPlaying(!state.playing); break;
      case "ArrowRight":
        if (inField) { handled = false; break; }
        state.playing = false; setFrame(state.frame + by, true); break;
      case "ArrowLeft":
        if (inField) { handled = false; break; }
        state.playing = false; setFrame(state.frame - by, true); break;
      case "Home":
        if (inField) { handled = false; break; }
        state.playing = false; setFrame(0, true); break;
      case "End":
        if (inField) { handled = false; break; }
        state.playing = false; setFrame(Number.MAX_SAFE_INTEGER, true); break;
      case "r": case "R": state.playing = false; setFrame(0, true); break;
      case "a": case "A": setRun(cycle(allocators, state.allocator, ev.key === "A" ? -1 : 1), state.blockSize, state.seed); break;
      case "b": setRun(state.allocator, cycle(blockSizes, state.blockSize, 1), state.seed); break;
      case "B": setRun(state.allocator, cycle(blockSizes, state.blockSize, -1), state.seed); break;
      case "s": setRun(state.allocator, state.blockSize, cycle(seeds, state.seed, 1)); break;
      case "S": setRun(state.allocator, state.blockSize, cycle(seeds, state.seed, -1)); break;
      case "+": case "=": state.speedIndex = Math.min(SPEEDS.length - 1, state.speedIndex + 1); syncControls(); break;
      case "-": case "_": state.speedIndex = Math.max(0, state.speedIndex - 1); syncControls(); break;
      default: handled = false;
    }
    if (handled) ev.preventDefault();
  });

  // ---- pool grid -----------------------------------------------------------------------------
  let poolGeometry = null; // {slotW, rowH, blockSize, numBlocks}

  function sizeCanvas(canvas, cssHeight) {
    const dpr = window.devicePixelRatio || 1;
    const cssWidth = canvas.parentElement.clientWidth;
    canvas.style.height = cssHeight + "px";
    const w = Math.max(1, Math.round(cssWidth * dpr));
    const h = Math.max(1, Math.round(cssHeight * dpr));
    if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { ctx, cssWidth };
  }

  function drawPool(run, dec) {
    const nb = run.num_blocks, bs = run.block_size;
    const totalSlots = nb * bs;
    const rows = Math.ceil(totalSlots / SLOTS_PER_ROW);
    const cssWidth = el.pool.parentElement.clientWidth;
    const slotW = cssWidth / SLOTS_PER_ROW;
    const rowH = Math.max(6, Math.min(16, Math.round(slotW * 1.4)));
    const { ctx } = sizeCanvas(el.pool, rows * rowH);
    poolGeometry = { slotW, rowH, blockSize: bs, numBlocks: nb };
    ctx.clearRect(0, 0, cssWidth, rows * rowH);
    const base = state.frame * nb * 3;
    const pool = dec.pools;
    const gap = bs * slotW >= 5 ? 1 : 0; // separate blocks only where there is room to
    const vgap = rowH >= 8 ? 1 : 0;
    const selected = [];
    for (let i = 0; i < nb; i++) {
      const owner = pool[base + i * 3], tokens = pool[base + i * 3 + 1], reserved = pool[base + i * 3 + 2];
      let slot = i * bs;
      // A block wraps only when SLOTS_PER_ROW is not a multiple of its size; draw per row piece.
      let drawn = 0;
      while (drawn < bs) {
        const col = slot % SLOTS_PER_ROW, row = Math.floor(slot / SLOTS_PER_ROW);
        const piece = Math.min(bs - drawn, SLOTS_PER_ROW - col);
        const x = col * slotW, y = row * rowH;
        const last = drawn + piece === bs;
        const w = piece * slotW - (last ? gap : 0), h = rowH - vgap;
        ctx.fillStyle = FREE_COLOR;
        ctx.fillRect(x, y, w, h);
        if (owner >= 0) {
          const tokIn = Math.max(0, Math.min(piece, tokens - drawn));
          const resIn = Math.max(0, Math.min(piece - tokIn, tokens + reserved - drawn - tokIn));
          if (tokIn > 0) { ctx.fillStyle = tokenColor(owner); ctx.fillRect(x, y, Math.min(w, tokIn * slotW), h); }
          if (resIn > 0) {
            ctx.fillStyle = reservedColor(owner);
            ctx.fillRect(x + tokIn * slotW, y, Math.min(w - tokIn * slotW, resIn * slotW), h);
          }
          if (owner === state.selectedRid) selected.push([x, y, w, h]);
        }
        drawn += piece;
        slot += piece;
      }
    }
    if (state.hoverCell >= 0 && state.hoverCell < nb) {
      const slot = state.hoverCell * bs;
      const col = slot % SLOTS_PER_ROW, row = Math.floor(slot / SLOTS_PER_ROW);
      ctx.strokeStyle = "#ffb000";
      ctx.lineWidth = 2;
      ctx.strokeRect(col * slotW + 1, row * rowH + 1, Math.min(bs, SLOTS_PER_ROW - col) * slotW - 2, rowH - 2);
    }
    ctx.strokeStyle = "#111";
    ctx.lineWidth = 1.5;
    for (const [x, y, w, h] of selected) ctx.strokeRect(x + 0.75, y + 0.75, Math.max(1, w - 1.5), Math.max(1, h - 1.5));

    let used = 0, tokenCells = 0;
    for (let i = 0; i < nb; i++) {
      if (pool[base + i * 3] >= 0) { used++; if (pool[base + i * 3 + 1] > 0) tokenCells++; }
    }
    el.pool.setAttribute("aria-label", "Physical pool of " + nb + " blocks of " + bs + " slots: " + used +
      " owned (" + tokenCells + " holding tokens), " + (nb - used) + " free");
    const unit = run.allocator === "paged" ? "block" : "cell";
    el.poolCaption.textContent = nb + " " + unit + "s × " + bs + " slot" + (bs === 1 ? "" : "s") + " = " +
      totalSlots + " token slots, " + SLOTS_PER_ROW + " slots per row" +
      (run.allocator === "paged" ? "" : " (contiguous reservations shown in cells of " + bs + " slot" + (bs === 1 ? "" : "s") + ")");
  }

  function cellAt(ev) {
    if (!poolGeometry) return -1;
    const rect = el.pool.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const col = Math.floor(x / poolGeometry.slotW), row = Math.floor(y / poolGeometry.rowH);
    if (col < 0 || col >= SLOTS_PER_ROW || row < 0) return -1;
    const cell = Math.floor((row * SLOTS_PER_ROW + col) / poolGeometry.blockSize);
    return cell < poolGeometry.numBlocks ? cell : -1;
  }
  function describeCell(cell) {
    const run = currentRun();
    if (!run || cell < 0) return "Hover or tap a block to see its owner.";
    const dec = decodeRun(run);
    const base = state.frame * run.num_blocks * 3 + cell * 3;
    const owner = dec.pools[base], tokens = dec.pools[base + 1], reserved = dec.pools[base + 2];
    const name = (run.allocator === "paged" ? "Block " : "Cell ") + cell;
    if (owner < 0) return name + ": free";
    const refs = run.allocator === "paged" ? dec.shared[state.frame].get(cell) || 0 : 0;
    return name + ": request " + owner + ", " + tokens + " token" + (tokens === 1 ? "" : "s") +
      " held, " + reserved + " reserved empty, of " + run.block_size +
      (refs > 1 ? "; shared by " + refs + " sequences (copy-on-write)" : "");
  }
  el.pool.addEventListener("mousemove", (ev) => {
    const cell = cellAt(ev);
    if (cell !== state.hoverCell) { state.hoverCell = cell; el.cellInfo.textContent = describeCell(cell); render(); }
  });
  el.pool.addEventListener("mouseleave", () => { state.hoverCell = -1; render(); });
  el.pool.addEventListener("click", (ev) => {
    const cell = cellAt(ev);
    state.hoverCell = cell;
    el.cellInfo.textContent = describeCell(cell);
    const run = currentRun();
    if (run && cell >= 0) {
      const owner = decodeRun(run).pools[state.frame * run.num_blocks * 3 + cell * 3];
      state.selectedRid = owner >= 0 && owner !== state.selectedRid ? owner : null;
    }
    render();
  });

  // ---- block tables --------------------------------------------------------------------------
  function tableChips(blocks, shared) {
    // Collapse runs of consecutive physical ids: contiguous allocation shows as one chip. A run
    // also breaks where sharing changes, so a shared chip holds only blocks of one refcount.
    const chips = [];
    const refs = (b) => shared.get(b) || 0;
    let start = 0;
    for (let i = 1; i <= blocks.length; i++) {
      if (i === blocks.length || blocks[i] !== blocks[i - 1] + 1 || refs(blocks[i]) !== refs(blocks[start])) {
        chips.push({
          text: i - 1 === start
            ? start + "→" + blocks[start]
            : start + "–" + (i - 1) + "→" + blocks[start] + "–" + blocks[i - 1],
          refcount: refs(blocks[start]),
        });
        start = i;
      }
    }
    return chips;
  }
  function chipHtml(chip) {
    if (chip.refcount < 2) return '<span class="chip">' + chip.text + "</span>";
    return '<span class="chip shared" title="shared by ' + chip.refcount + ' sequences (copy-on-write)">' +
      chip.text + '<span class="refs" aria-label=", shared by ' + chip.refcount + ' sequences"> ×' +
      chip.refcount + "</span></span>";
  }
  // "sample" for parallel sampling, "beam" for beam search: what one sequence of a group is called.
  const memberName = DATA.group_kind === "beam" ? "beam" : "sample";
  function drawTables(run, dec) {
    const rows = dec.tables[state.frame];
    const shared = dec.shared[state.frame];
    const groupSize = new Map();
    for (const t of rows) groupSize.set(t.rid, (groupSize.get(t.rid) || 0) + 1);
    el.tablesCount.textContent = "(" + groupSize.size + " running" +
      (rows.length > groupSize.size ? ", " + rows.length + " sequences, " + shared.size + " shared blocks" : "") + ")";
    if (rows.length === 0) {
      el.tables.innerHTML = '<li class="empty">No running requests at this step.</li>';
      return;
    }
    const parts = [];
    for (const t of rows) {
      const chips = tableChips(t.blocks, shared);
      let chipsHtml = "";
      const shown = Math.min(chips.length, MAX_CHIPS_PER_TABLE);
      for (let i = 0; i < shown; i++) chipsHtml += chipHtml(chips[i]);
      if (chips.length > shown) chipsHtml += '<span class="chip more">+' + (chips.length - shown) + " more runs</span>";
      const sel = t.rid === state.selectedRid;
      const nblk = t.blocks.length;
      const inGroup = groupSize.get(t.rid) > 1;
      const nshared = t.blocks.reduce((n, b) => n + ((shared.get(b) || 0) > 1 ? 1 : 0), 0);
      const name = "req " + t.rid + (inGroup ? " · " + memberName + " " + t.sample : "");
      const spoken = "Request " + t.rid + (inGroup ? " " + memberName + " " + t.sample : "");
      const classes = [sel ? "selected" : "", inGroup ? "member" : "", inGroup && t.sample > 0 ? "later" : ""]
        .filter(Boolean).join(" ");
      parts.push('<li data-rid="' + t.rid + '" data-sample="' + t.sample + '"' +
        (classes ? ' class="' + classes + '"' : "") + (inGroup ? ' style="--c:' + tokenColor(t.rid) + '"' : "") + ">" +
        '<button type="button" class="rid" style="--c:' + tokenColor(t.rid) + '" aria-pressed="' + sel +
        '" aria-label="' + spoken + ": " + t.ntok + " tokens in " + nblk + " blocks" +
        (nshared ? ", " + nshared + " shared" : "") + "; outline the request's blocks in the pool" +
        '">' + name + "</button>" +
        '<span class="ntok">' + t.ntok + " tokens · " + nblk + " block" + (nblk === 1 ? "" : "s") +
        (nshared ? " · " + nshared + " shared" : "") + "</span>" +
        '<span class="chips">' + chipsHtml + "</span></li>");
    }
    const focusedRow = document.activeElement && el.tables.contains(document.activeElement)
      ? document.activeElement.closest("li[data-rid]") : null;
    const focusedKey = focusedRow ? [focusedRow.dataset.rid, focusedRow.dataset.sample] : undefined;
    const scroll = el.tables.scrollTop;
    el.tables.innerHTML = parts.join("");
    el.tables.scrollTop = scroll;
    if (focusedKey !== undefined) {
      const again = el.tables.querySelector('li[data-rid="' + focusedKey[0] + '"][data-sample="' + focusedKey[1] + '"] button');
      if (again) again.focus({ preventScroll: true });
    }
  }
  el.tables.setAttribute("aria-label", "Block tables of the running requests");
  function toggleRow(target) {
    const li = target.closest("li[data-rid]");
    if (!li || !target.closest("button")) return;
    const rid = Number(li.dataset.rid);
    state.selectedRid = state.selectedRid === rid ? null : rid;
    render();
  }
  el.tables.addEventListener("click", (ev) => toggleRow(ev.target));

  // ---- counters and fragmentation ------------------------------------------------------------
  function setCounter(node, text, value) {
    node.textContent = text;
    node.dataset.value = String(value);
  }
  function drawCounters(run) {
    const c = run.c, f = state.frame;
    setCounter(el.c.step, fmtInt(c.step[f]), c.step[f]);
    setCounter(el.c.running, fmtInt(c.running[f]), c.running[f]);
    setCounter(el.c.waiting, fmtInt(c.waiting[f]), c.waiting[f]);
    setCounter(el.c.finished, fmtInt(c.finished[f]), c.finished[f]);
    setCounter(el.c.blocks, c.used_blocks[f] + " / " + run.num_blocks, c.used_blocks[f]);
    setCounter(el.c.waste, fmtPct(c.waste_pct[f]), c.waste_pct[f]);
    setCounter(el.c.preemptions, fmtInt(c.preemptions[f]), c.preemptions[f]);

    const total = run.num_blocks * run.block_size;
    const tok = c.token_slots[f], res = c.reserved_slots[f], frag = c.internal_frag_slots[f];
    const ext = c.external_frag_slots ? c.external_frag_slots[f] : 0;
    const free = c.free_slots ? c.free_slots[f] : Math.max(0, total - tok - res - frag - ext);
    const parts = [["token", tok], ["reserved", res], ["frag", frag], ["ext", ext], ["free", free]];
    for (const [name, value] of parts) {
      el.seg[name].style.width = pctOf(value, total) + "%";
      el.f[name].textContent = value + " slots (" + pctOf(value, total).toFixed(1) + " %)";
    }
    el.fExtItem.hidden = !c.external_frag_slots;
    el.fragBar.setAttribute("aria-label", "Pool of " + total + " slots: " + tok + " real tokens, " + res +
      " allocated for coming tokens, " + frag + " allocated but never filled, " +
      (c.external_frag_slots ? ext + " free but too scattered, " : "") + free + " free");

    const others = allocators.filter((a) => a !== run.allocator)
      .map((a) => runs.get(runKey(a, run.block_size, run.seed)))
      .filter(Boolean);
    if (others.length) {
      const here = (r) => r.c.running[Math.min(f, r.n - 1)];
      el.compare.innerHTML = "Same " + total + "-slot pool, requests resident at this step: " +
        [run].concat(others).map((r) => "<b>" + r.allocator + "</b> " + here(r)).join(" · ");
    } else {
      el.compare.textContent = "";
    }
  }

  // ---- time chart ----------------------------------------------------------------------------
  const SERIES_COLORS = ["#1f5fbf", "#7e22ce", "#15803d", "#0e7490", "#be185d", "#4d7c0f"];
  function drawChart(run) {
    const sameGrid = allocators.map((a) => runs.get(runKey(a, run.block_size, run.seed))).filter(Boolean);
    const items = sameGrid.map((r, idx) => ["running · " + r.allocator, SERIES_COLORS[idx % SERIES_COLORS.length], r === run]);
    items.push(["waste % (" + run.allocator + ")", FRAG_COLOR, true]);
    // Lay the legend out first (it wraps on narrow screens), then fit the plot below it.
    const cssWidth0 = el.chart.parentElement.clientWidth;
    const measure = el.chart.getContext("2d");
    measure.font = "11px system-ui, sans-serif";
    const placed = [];
    let lx = 0, line = 0;
    for (const [label, color, bold] of items) {
      const width = measure.measureText(label).width + 24;
      if (lx > 0 && lx + width > cssWidth0) { lx = 0; line += 1; }
      placed.push([label, color, bold, lx, line]);
      lx += width;
    }
    const legendH = (line + 1) * 14 + 4;
    const plotH = 120;
    const height = legendH + plotH + 22;
    const { ctx, cssWidth } = sizeCanvas(el.chart, height);
    ctx.clearRect(0, 0, cssWidth, height);
    const padL = 34, padR = 44, padT = legendH + 6, padB = 18;
    const w = Math.max(10, cssWidth - padL - padR), h = height - padT - padB;
    const n = Math.max(...sameGrid.map((r) => r.n));
    // A loop, not Math.max(...array): long runs would overflow the argument list.
    const maxRunning = sameGrid.reduce((m, r) => r.c.running.reduce((a, b) => Math.max(a, b), m), 1);
    const xAt = (i) => padL + (n > 1 ? (i / (n - 1)) * w : 0);

    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "left";
    for (const [label, color, bold, x, row] of placed) {
      ctx.fillStyle = color;
      ctx.fillRect(x, row * 14 + 5, 10, bold ? 3 : 2);
      ctx.fillStyle = "#1d2330";
      ctx.fillText(label, x + 13, row * 14 + 11);
    }
    ctx.strokeStyle = "#d8dce3";
    ctx.lineWidth = 1;
    ctx.strokeRect(padL, padT, w, h);
    ctx.fillStyle = "#5b6474";
    ctx.textAlign = "right";
    ctx.fillText(String(maxRunning), padL - 4, padT + 8);
    ctx.fillText("0", padL - 4, padT + h);
    ctx.textAlign = "left";
    ctx.fillText("100 %", padL + w + 4, padT + 8);
    ctx.fillText("0 %", padL + w + 4, padT + h);

    // Running requests of every allocator on this block size and seed (left axis).
    sameGrid.forEach((r, idx) => {
      ctx.strokeStyle = SERIES_COLORS[idx % SERIES_COLORS.length];
      ctx.lineWidth = r === run ? 2 : 1;
      ctx.setLineDash(r === run ? [] : [4, 3]);
      ctx.beginPath();
      for (let i = 0; i < r.n; i++) {
        const y = padT + h - (r.c.running[i] / maxRunning) * h;
        if (i === 0) ctx.moveTo(xAt(i), y); else ctx.lineTo(xAt(i), y);
      }
      ctx.stroke();
    });
    ctx.setLineDash([]);
    // Waste % of the shown run (right axis).
    ctx.strokeStyle = FRAG_COLOR;
    ctx.lineWidth = 2;
    ctx.beginPath();
    for (let i = 0; i < run.n; i++) {
      const y = padT + h - (Math.min(100, run.c.waste_pct[i]) / 100) * h;
      if (i === 0) ctx.moveTo(xAt(i), y); else ctx.lineTo(xAt(i), y);
    }
    ctx.stroke();
    // Current step.
    ctx.strokeStyle = "#111";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(xAt(state.frame), padT);
    ctx.lineTo(xAt(state.frame), padT + h);
    ctx.stroke();

    ctx.fillStyle = "#5b6474";
    ctx.textAlign = "center";
    ctx.fillText("step", padL + w / 2, height - 4);
    el.chart.setAttribute("aria-label", "Running requests per allocator and waste % over " + run.n +
      " steps; the vertical line marks step " + run.c.step[state.frame]);
  }

  // ---- render --------------------------------------------------------------------------------
  function render() {
    syncControls();
    workloadLine();
    const run = currentRun();
    if (!run) {
      el.tables.innerHTML = '<li class="empty">No recorded run for this combination.</li>';
      for (const node of Object.values(el.c)) setCounter(node, "–", "");
      const ctx = el.pool.getContext("2d");
      ctx.clearRect(0, 0, el.pool.width, el.pool.height);
      return;
    }
    const dec = decodeRun(run);
    drawCounters(run);
    drawPool(run, dec);
    drawTables(run, dec);
    drawChart(run);
    if (state.hoverCell >= 0) el.cellInfo.textContent = describeCell(state.hoverCell);
  }

  function workloadLine() {
    const w = DATA.workload || {};
    const name = (w.by_seed && w.by_seed[String(state.seed)]) || w.name || "";
    el.workloadLine.textContent = [
      name,
      DATA.num_slots ? DATA.num_slots + " token slots for every allocator" : "",
      DATA.max_model_len ? "max_model_len " + DATA.max_model_len : "",
      DATA.arrival ? "arrival " + DATA.arrival : "",
      runs.size + " recorded runs",
    ].filter(Boolean).join(" · ");
  }

  let resizeQueued = false;
  window.addEventListener("resize", () => {
    if (resizeQueued) return;
    resizeQueued = true;
    requestAnimationFrame(() => { resizeQueued = false; render(); });
  });

  // A small hook for tests and for the curious (browser console): read-only views of the data.
  window.pagedkvViz = {
    state: () => Object.assign({}, state),
    frameData: (frame) => {
      const run = currentRun();
      const dec = decodeRun(run);
      const nb = run.num_blocks;
      const f = frame === undefined ? state.frame : frame;
      return {
        pool: Array.from(dec.pools.subarray(f * nb * 3, (f + 1) * nb * 3)),
        tables: dec.tables[f].map((t) => [t.rid, t.sample, t.ntok, t.blocks.slice()]),
        shared: Array.from(dec.shared[f].entries()).sort((a, b) => a[0] - b[0]),
      };
    },
    runs: () => DATA.runs.map((r) => [r.allocator, r.block_size, r.seed, r.n]),
    // RGBA of the pool canvas at the middle of the first slot of `cell` (device pixels).
    cellColor: (cell) => {
      const g = poolGeometry;
      const slot = cell * g.blockSize;
      const dpr = window.devicePixelRatio || 1;
      const x = Math.floor(((slot % SLOTS_PER_ROW) + 0.5) * g.slotW * dpr);
      const y = Math.floor((Math.floor(slot / SLOTS_PER_ROW) + 0.5) * g.rowH * dpr);
      return Array.from(el.pool.getContext("2d").getImageData(x, y, 1, 1).data);
    },
  };

  render();
  document.body.dataset.ready = "true";
  }
})();
