// A small live chart on a canvas: the latency of each partial and final over the last minute.

const COLORS = { partial: "#1f6feb", final: "#e36209" };
const WINDOW_S = 60;

export class LatencyChart {
  constructor(canvas) {
    this.canvas = canvas;
    this.points = []; // {t: performance.now() ms, kind, ms}
    this.t0 = null;
  }

  add(kind, latencyMs, t = performance.now()) {
    if (this.t0 === null) this.t0 = t;
    this.points.push({ t, kind, ms: latencyMs });
    const keep = t - WINDOW_S * 1000;
    while (this.points.length && this.points[0].t < keep) this.points.shift();
    this.draw();
  }

  clear() {
    this.points = [];
    this.t0 = null;
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || c.width, h = c.clientHeight || c.height;
    if (c.width !== Math.round(w * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const fg = getComputedStyle(c).color || "#888";
    const pad = { l: 52, r: 10, t: 10, b: 22 };
    const top = Math.max(200, ...this.points.map((p) => p.ms)) * 1.1;
    const now = this.points.length ? this.points[this.points.length - 1].t : performance.now();
    const x = (t) => pad.l + (w - pad.l - pad.r) * (1 - (now - t) / (WINDOW_S * 1000));
    const y = (v) => h - pad.b - (h - pad.t - pad.b) * (v / top);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = fg;
    g.strokeStyle = "rgba(128,128,128,0.35)";
    g.lineWidth = 1;
    for (const v of ticks(top)) {
      g.beginPath(); g.moveTo(pad.l, y(v)); g.lineTo(w - pad.r, y(v)); g.stroke();
      g.fillText(v >= 1000 ? `${v / 1000} s` : `${v} ms`, 4, y(v) + 4);
    }
    g.fillText(`last ${WINDOW_S} s`, w - pad.r - 52, h - 6);
    let lx = pad.l;
    for (const [kind, col] of Object.entries(COLORS)) {
      g.fillStyle = col; g.fillRect(lx, h - 13, 10, 8);
      g.fillStyle = fg; g.fillText(kind, lx + 14, h - 6);
      lx += 70;
      const pts = this.points.filter((p) => p.kind === kind);
      g.strokeStyle = col; g.fillStyle = col; g.lineWidth = 1.5;
      g.beginPath();
      pts.forEach((p, i) => (i ? g.lineTo(x(p.t), y(p.ms)) : g.moveTo(x(p.t), y(p.ms))));
      g.stroke();
      for (const p of pts) { g.beginPath(); g.arc(x(p.t), y(p.ms), 2.8, 0, 2 * Math.PI); g.fill(); }
    }
  }
}

function ticks(top) {
  const raw = top / 4;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = 0; v <= top; v += step) out.push(v);
  return out;
}
