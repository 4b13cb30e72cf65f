// Live tab: the microphone -> AudioWorklet (pcm-worklet.js: resampled to the session's declared
// rate, PCM16 frames of 20 ms) -> WS /v1/realtime (input_audio_buffer.append) -> partial deltas
// shown provisionally, finals (…transcription.completed) committed; server VAD on by default,
// manual commit; the latency of every partial and final, summed up and charted.
//
// Latency (the definitions of bench/bench_serve.py): a partial delta carries `audio_end_ms`, the
// end of the audio it covers; its latency is from sending the frame holding that sample to
// receiving the delta. A final's latency is from sending the frame that ends its committed audio
// (`input_audio_buffer.committed.audio_end_ms`: where server VAD cut, or the manual commit) to
// receiving the final.

import { PageError, clock, el, ms, percentile, showError } from "./api.js";
import { LatencyChart } from "./chart.js";
import { saveFile } from "./formats.js";

const RATE = 16000;          // the rate the page declares (?sample_rate=): the models' rate, no resampling on the server
const FRAME_MS = 20;
const MAX_RECORD_S = 1800;   // what "Save recording" keeps (30 min of 16 kHz PCM16: 58 MB)
const EMPTY_COMMIT = "input_audio_buffer_commit_empty";

function b64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

/** Mono PCM16 samples -> a WAV file (Blob). */
export function wavBlob(pcm, rate) {
  const head = new DataView(new ArrayBuffer(44));
  const text = (o, s) => [...s].forEach((c, i) => head.setUint8(o + i, c.charCodeAt(0)));
  text(0, "RIFF"); head.setUint32(4, 36 + pcm.byteLength, true); text(8, "WAVE");
  text(12, "fmt "); head.setUint32(16, 16, true); head.setUint16(20, 1, true); head.setUint16(22, 1, true);
  head.setUint32(24, rate, true); head.setUint32(28, rate * 2, true); head.setUint16(32, 2, true); head.setUint16(34, 16, true);
  text(36, "data"); head.setUint32(40, pcm.byteLength, true);
  return new Blob([head, pcm], { type: "audio/wav" });
}

/** Why the microphone cannot be used here (null: it can). */
export function micUnavailable() {
  if (!window.isSecureContext || !navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    return new PageError(`Browsers allow the microphone only on https:// pages or on localhost; this page is ` +
      `${location.origin}. Open it as http://localhost:${location.port || 80} on the server's machine, or put the ` +
      `server behind TLS (docs/SERVING.md, "The web page").`, "insecure_context");
  }
  if (!window.AudioWorkletNode) return new PageError("This browser has no AudioWorklet; use a current Chrome, Firefox, Safari or Edge.", "no_audio_worklet");
  return null;
}

function micError(e) {
  const n = e && e.name;
  if (n === "NotAllowedError" || n === "SecurityError") {
    return new PageError("Microphone permission denied. Allow the microphone for this site (the icon in the " +
      "address bar, or the browser's site settings), then press Start again.", "mic_denied");
  }
  if (n === "NotFoundError" || n === "OverconstrainedError") return new PageError("No microphone found.", "no_microphone");
  if (n === "NotReadableError") return new PageError("The microphone could not be opened (is another program using it?).", "mic_busy");
  return new PageError(`The microphone could not be started: ${(e && e.message) || e}`, "mic_failed");
}

/** One Realtime session: the WebSocket, the audio graph and what was sent when. */
export class LiveSession {
  constructor(api, on) {
    this.api = api;
    this.on = on;                 // {event(ev), latency(kind, ms, itemId), frame(pcm), closed(PageError|null)}
    this.rate = RATE;
    this.sent = 0;                // samples sent
    this.marks = [];              // [samples sent after a frame, performance.now() when sent], flat
    this.chunks = [];             // the PCM sent (Int16Array frames), up to MAX_RECORD_S
    this.kept = 0;
    this.commitEnd = new Map();   // item id -> committed audio end (samples)
    this.pending = new Set();     // committed items without a final yet
    this.committedUpTo = 0;
    this.commitAnswered = true;
    this.stopping = false;
  }

  async start({ vad, language }) {
    const why = micUnavailable();
    if (why) throw why;
    try {
      this.media = await navigator.mediaDevices.getUserMedia({ audio: {
        channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
    } catch (e) {
      throw micError(e);
    }
    try {
      await this.connect();
      this.update({ vad, language });
      await this.startAudio();
    } catch (e) {
      this.teardown();
      throw e;
    }
  }

  /** Open the WebSocket; resolves at transcription_session.created (asks for the key when refused). */
  async connect() {
    for (;;) {
      try {
        return await this.open();
      } catch (e) {
        if (e.code !== "invalid_api_key") throw e;
        await this.api.askKey("The server did not accept the API key for streaming. Enter it again.");
      }
    }
  }

  open() {
    const { url, protocols } = this.api.realtime(RATE);
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(url, protocols);
      this.ws = ws;
      let created = false;
      ws.onmessage = (m) => {
        const ev = JSON.parse(m.data);
        if (!created && ev.type === "error") return reject(new PageError(ev.error.message, ev.error.code));
        if (!created && ev.type === "transcription_session.created") {
          created = true;
          this.rate = ev.session.input_audio_sample_rate;
          resolve(ev.session);
        }
        this.handle(ev, performance.now());
      };
      ws.onclose = (e) => {
        if (!created) return reject(new PageError(`Could not open the stream (WebSocket closed, code ${e.code}` +
          `${e.reason ? ": " + e.reason : ""}).`, e.code === 1008 ? "invalid_api_key" : "server_gone"));
        this.teardown();
        this.on.closed(this.stopping ? null : new PageError(`The connection to the server closed (code ${e.code}` +
          `${e.reason ? ": " + e.reason : ""}). Press Start to reconnect.`, "server_gone"));
      };
    });
  }

  async startAudio() {
    const ctx = this.ctx = new AudioContext();
    await ctx.audioWorklet.addModule("/ui/pcm-worklet.js");
    const src = ctx.createMediaStreamSource(this.media);
    const node = this.node = new AudioWorkletNode(ctx, "pcm-frames", {
      numberOfInputs: 1, numberOfOutputs: 1, channelCount: 1, channelCountMode: "explicit",
      processorOptions: { targetRate: this.rate, frameMs: FRAME_MS } });
    node.port.onmessage = (m) => (m.data === "stopped" ? this.audioStopped && this.audioStopped() : this.frame(m.data));
    const mute = ctx.createGain();
    mute.gain.value = 0; // the graph must reach the destination to be pulled; nothing is heard
    src.connect(node).connect(mute).connect(ctx.destination);
    await ctx.resume();
  }

  frame(buf) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return;
    const pcm = new Int16Array(buf);
    this.ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: b64(new Uint8Array(buf)) }));
    this.sent += pcm.length;
    this.marks.push(this.sent, performance.now());
    if (this.kept + pcm.length <= MAX_RECORD_S * this.rate) { this.chunks.push(pcm); this.kept += pcm.length; }
    this.on.frame(pcm);
  }

  /** performance.now() when the frame holding stream sample `s` (0-based) was sent. */
  sentAt(s) {
    let lo = 0, hi = this.marks.length / 2 - 1;
    if (hi < 0) return null;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.marks[2 * mid] >= s) hi = mid; else lo = mid + 1;
    }
    return this.marks[2 * lo + 1];
  }

  handle(ev, now) {
    const toSamples = (v) => Math.round((v * this.rate) / 1000);
    let lat = null; // [kind, ms] of this event, reported after the event itself
    if (ev.type === "input_audio_buffer.committed") {
      const end = toSamples(ev.audio_end_ms);
      this.commitEnd.set(ev.item_id, end);
      this.pending.add(ev.item_id);
      this.committedUpTo = Math.max(this.committedUpTo, end);
      this.commitAnswered = true;
    } else if (ev.type === "conversation.item.input_audio_transcription.delta" && ev.audio_end_ms !== undefined) {
      const t = this.sentAt(toSamples(ev.audio_end_ms));
      if (t !== null) lat = ["partial", now - t];
    } else if (ev.type === "conversation.item.input_audio_transcription.completed") {
      const end = this.commitEnd.get(ev.item_id);
      const t = end === undefined ? null : this.sentAt(end);
      if (t !== null) lat = ["final", now - t];
      this.pending.delete(ev.item_id);
    } else if (ev.type === "conversation.item.input_audio_transcription.failed") {
      this.pending.delete(ev.item_id);
    } else if (ev.type === "error") {
      this.commitAnswered = true;
      if (this.stopping && ev.error.code === EMPTY_COMMIT) return;
    }
    this.on.event(ev, now);
    if (lat) this.on.latency(lat[0], lat[1], ev.item_id);
  }

  send(obj) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(obj));
  }

  update({ vad, language }) {
    const session = { input_audio_format: "pcm16", input_audio_sample_rate: RATE,
      turn_detection: vad ? { type: "server_vad" } : null };
    if (language !== undefined) session.input_audio_transcription = { language: language || null };
    this.send({ type: "transcription_session.update", session });
  }

  commit() {
    this.commitAnswered = false;
    this.send({ type: "input_audio_buffer.commit" });
  }

  /** Stop the microphone, commit what is left, wait for the finals (at most 60 s), close. */
  async stop() {
    this.stopping = true;
    await this.stopAudio();
    if (this.sent > this.committedUpTo) {
      this.commit();
      await until(() => this.commitAnswered || !this.ws, 10000);
    }
    await until(() => this.pending.size === 0 || !this.ws, 60000);
    if (this.ws) this.ws.close(1000, "done");
    this.teardown();
  }

  async stopAudio() {
    if (!this.node) return;
    const done = new Promise((r) => { this.audioStopped = r; });
    this.node.port.postMessage("stop");
    await Promise.race([done, new Promise((r) => setTimeout(r, 500))]);
    this.releaseAudio();
  }

  releaseAudio() {
    if (this.media) this.media.getTracks().forEach((t) => t.stop());
    if (this.ctx && this.ctx.state !== "closed") this.ctx.close().catch(() => {});
    this.media = this.ctx = this.node = null;
  }

  teardown() {
    this.releaseAudio();
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
    this.ws = null;
  }

  /** The PCM16 sent so far (what the server received), one Int16Array. */
  recording() {
    const out = new Int16Array(this.kept);
    let o = 0;
    for (const c of this.chunks) { out.set(c, o); o += c.length; }
    return out;
  }

  recordingBase64() {
    return b64(new Uint8Array(this.recording().buffer));
  }
}

function until(pred, timeoutMs) {
  return new Promise((resolve) => {
    const t0 = performance.now();
    const tick = () => (pred() || performance.now() - t0 > timeoutMs ? resolve() : setTimeout(tick, 50));
    tick();
  });
}

export class LiveTab {
  constructor(api, ui) {
    this.api = api;
    this.ui = ui; // {mic, commit, vad, language, save, level, state, error, items, latency, chart}
    this.chart = new LatencyChart(ui.chart);
    this.session = null;
    this.last = null;             // the last session, for "Save recording"
    this.items = new Map();
    this.latencies = [];          // {kind, ms, item, t}
    ui.mic.addEventListener("click", () => (this.session ? this.stop() : this.start()));
    ui.commit.addEventListener("click", () => this.session && this.session.commit());
    ui.vad.addEventListener("change", () => this.session && this.session.update({ vad: ui.vad.checked }));
    ui.language.addEventListener("change", () => this.session && this.session.update({ vad: ui.vad.checked, language: ui.language.value }));
    ui.save.addEventListener("click", () => this.last && saveFile("recording.wav", wavBlob(this.last.recording(), this.last.rate)));
    this.summary();
    this.chart.draw();
  }

  async start() {
    const { ui } = this;
    showError(ui.error, null);
    ui.mic.disabled = true;
    ui.mic.textContent = "Starting…";
    const s = new LiveSession(this.api, {
      event: (ev, now) => this.event(ev, now),
      latency: (kind, v, item) => this.latency(kind, v, item),
      frame: (pcm) => this.level(pcm),
      closed: (err) => this.ended(s, err),
    });
    try {
      this.items.clear();
      ui.items.replaceChildren();
      this.latencies = [];
      this.chart.clear();
      this.summary();
      this.session = this.last = s;
      await s.start({ vad: ui.vad.checked, language: ui.language.value || undefined });
      ui.mic.textContent = "■ Stop";
      ui.commit.disabled = false;
      ui.save.disabled = false;
      ui.state.textContent = `Listening (${s.rate / 1000} kHz PCM16 over /v1/realtime${ui.vad.checked ? ", server VAD" : ", commit by hand"}).`;
    } catch (e) {
      this.session = null;
      showError(ui.error, e);
      ui.mic.textContent = "🎤 Start microphone";
      ui.state.textContent = "";
    } finally {
      ui.mic.disabled = false;
    }
  }

  async stop() {
    const { ui } = this;
    const s = this.session;
    ui.mic.disabled = true;
    ui.commit.disabled = true;
    ui.state.textContent = "Stopping: waiting for the last final…";
    await s.stop();
    this.ended(s, null);
  }

  ended(s, err) {
    if (this.session !== s) return;
    const { ui } = this;
    this.session = null;
    ui.mic.disabled = false;
    ui.commit.disabled = true;
    ui.mic.textContent = "🎤 Start microphone";
    ui.level.style.width = "0";
    ui.state.textContent = err ? "" : "Stopped.";
    if (err) showError(ui.error, err);
  }

  item(id) {
    let it = this.items.get(id);
    if (!it) {
      const text = el("span", { class: "text" });
      const meta = el("div", { class: "meta" });
      const li = el("li", { class: "partial", dataset: { itemId: id } }, text, meta);
      it = { li, text, meta, partial: "", final: null, start: null, end: null, partialMs: null, finalMs: null };
      this.items.set(id, it);
      this.ui.items.append(li);
    }
    return it;
  }

  event(ev, now) {
    const t = ev.type;
    if (t === "error") { showError(this.ui.error, new PageError(ev.error.message, ev.error.code)); return; }
    if (!ev.item_id) return;
    const it = this.item(ev.item_id);
    if (t === "input_audio_buffer.speech_started") it.start = ev.audio_start_ms;
    else if (t === "input_audio_buffer.committed") {
      it.start = ev.audio_start_ms;
      it.end = ev.audio_end_ms;
      Object.assign(it.li.dataset, { audioStartMs: ev.audio_start_ms, audioEndMs: ev.audio_end_ms });
    } else if (t === "conversation.item.input_audio_transcription.delta") it.partial += ev.delta;
    else if (t === "conversation.item.input_audio_transcription.completed") it.final = ev.transcript;
    else if (t === "conversation.item.input_audio_transcription.failed") it.failed = ev.error.message;
    else return;
    this.render(it);
  }

  render(it) {
    it.li.className = it.failed ? "failed" : it.final !== null ? "final" : "partial";
    it.text.textContent = it.failed ? `(failed: ${it.failed})` : it.final !== null ? (it.final || "(no words)") : (it.partial || "…");
    const span = it.start === null ? "" : `${clock(it.start / 1000)}${it.end === null ? " …" : " → " + clock(it.end / 1000)}`;
    const state = it.final !== null ? (it.finalMs === null ? "" : `final in ${ms(it.finalMs)}`)
      : it.partialMs === null ? "partial" : `partial in ${ms(it.partialMs)}`;
    it.meta.textContent = [span, state].filter(Boolean).join(" · ");
  }

  latency(kind, v, itemId) {
    this.latencies.push({ kind, ms: v, item: itemId, t: performance.now() });
    this.chart.add(kind, v);
    const it = this.items.get(itemId);
    if (it) {
      it[kind === "final" ? "finalMs" : "partialMs"] = v;
      this.render(it);
    }
    this.summary();
  }

  summary() {
    const cells = ["partial", "final"].map((kind) => {
      const v = this.latencies.filter((l) => l.kind === kind).map((l) => l.ms);
      return el("div", { class: "cell", id: `live-lat-${kind}`, dataset: { n: v.length } },
        el("span", { class: "big" }, ms(v.length ? v[v.length - 1] : null)),
        el("small", {}, `${kind}s: ${v.length} · p50 ${ms(percentile(v, 0.5))} · p95 ${ms(percentile(v, 0.95))}`));
    });
    this.ui.latency.replaceChildren(...cells);
  }

  level(pcm) {
    let sum = 0;
    for (let i = 0; i < pcm.length; i++) sum += pcm[i] * pcm[i];
    const db = 10 * Math.log10(sum / Math.max(1, pcm.length) / (32768 * 32768) + 1e-10);
    this.ui.level.style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100))}%`;
  }
}
