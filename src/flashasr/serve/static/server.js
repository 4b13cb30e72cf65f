// Server panel: GET /status every 2 s -> model, device, streams live, requests in flight,
// recent p50/p95 latencies, GPU memory; a banner while the server cannot be reached.

import { el, ms } from "./api.js";

const POLL_MS = 2000;

function lat(s) {
  return s && s.n ? `${ms(s.p50_ms)} / ${ms(s.p95_ms)} (${s.n})` : "–";
}

function bytes(n) {
  return n >= 1 << 30 ? `${(n / (1 << 30)).toFixed(2)} GiB` : `${(n / (1 << 20)).toFixed(0)} MiB`;
}

export function statusRows(s) {
  const m = s.model;
  const q = s.engine.queue_depth || {};
  const queued = Object.values(q).reduce((a, b) => a + b, 0);
  const gpu = s.gpu_memory_bytes;
  const audio = s.audio_seconds || {};
  const L = s.latency_ms || {};
  return [
    ["status", s.status === "ready" ? "ready" : "loading the model…", "srv-status"],
    ["model", m ? `${m.name} (${m.family})` : "–", "srv-model"],
    ["device", m ? `${m.device} · ${s.mode} mode` : s.mode, "srv-device"],
    ["streams live", String(s.streams_live), "srv-streams"],
    ["uploads in flight", String(s.uploads_in_flight), "srv-uploads"],
    ["engine", `${s.engine.requests_active} in flight, ${queued} waiting`, "srv-engine"],
    ["file p50 / p95", lat(L.request), "srv-lat-request"],
    ["partial p50 / p95", lat(L.partial), "srv-lat-partial"],
    ["final p50 / p95", lat(L.final), "srv-lat-final"],
    ["GPU memory", gpu ? `${bytes(gpu.allocated)} allocated, ${bytes(gpu.reserved)} reserved` : "– (no GPU)", "srv-gpu"],
    ["audio done", `${(audio.offline || 0).toFixed(1)} s files · ${(audio.stream || 0).toFixed(1)} s live`, "srv-audio"],
    ["key", s.limits.api_key_required ? "required" : "none", "srv-key"],
  ];
}

export class ServerPanel {
  constructor(api, ui, onStatus) {
    this.api = api;
    this.ui = ui; // {info, banner, conn}
    this.onStatus = onStatus;
    this.downSince = null;
  }

  async poll() {
    try {
      const s = await this.api.status();
      this.up(s);
      this.onStatus(s);
    } catch (e) {
      this.down(e);
    }
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  up(s) {
    const { info, banner, conn } = this.ui;
    if (this.downSince !== null) banner.hidden = true; // (the banner may also hold another message)
    this.downSince = null;
    conn.className = "conn ok";
    conn.textContent = s.status === "ready" ? "connected" : "connected, model loading";
    info.replaceChildren(...statusRows(s).flatMap(([k, v, id]) => [el("dt", {}, k), el("dd", { id }, v)]));
  }

  down(e) {
    const { banner, conn } = this.ui;
    if (this.downSince === null) this.downSince = new Date();
    conn.className = "conn bad";
    conn.textContent = "server unreachable";
    banner.textContent = `${e.message} Since ${this.downSince.toLocaleTimeString()}; retrying every ${POLL_MS / 1000} s.`;
    banner.hidden = false;
  }
}
