// File tab: a dropped or picked file -> POST /v1/audio/transcriptions (verbose_json, segment and
// word times) with upload progress -> segments (click to play), words lit while playing,
// downloads, and the request's speed factor (audio seconds / the server's seconds after the
// upload, from the Server-Timing reply header).

import { PageError, clock, el, errorFromBody, ms, showError } from "./api.js";
import { DOWNLOADS, saveFile } from "./formats.js";

/** "upload;dur=1.2, decode;dur=3" -> {upload: 1.2, decode: 3} (milliseconds). */
export function parseServerTiming(header) {
  const out = {};
  for (const part of (header || "").split(",")) {
    const [name, ...params] = part.trim().split(";");
    const dur = params.map((p) => p.trim()).find((p) => p.startsWith("dur="));
    if (name && dur) out[name.trim()] = parseFloat(dur.slice(4));
  }
  return out;
}

/** Each word of verbose_json's top-level `words` goes to the segment it starts in (sorted by time). */
export function wordsBySegment(segments, words) {
  const out = segments.map(() => []);
  if (!words || !segments.length) return out;
  for (const w of words) {
    let lo = 0, hi = segments.length - 1;
    while (lo < hi) { // the last segment starting at or before the word
      const mid = (lo + hi + 1) >> 1;
      if (segments[mid].start <= w.start + 0.01) lo = mid; else hi = mid - 1;
    }
    out[lo].push(w);
  }
  return out;
}

export class FileTab {
  constructor(api, ui) {
    this.api = api;
    this.ui = ui; // {drop, input, language, words, progress, bar, phase, error, result, stats, audio, segments, text, downloads}
    this.limitBytes = null;
    this.result = null;
    this.wordEls = [];   // [{start, end, node}] sorted by start
    this.segEls = [];
    this.litSeg = { i: -1 };
    this.litWord = { i: -1 };
    this.stopAt = null;
    this.raf = 0;
    this.busy = false;
    this.wire();
  }

  wire() {
    const { drop, input, audio } = this.ui;
    input.addEventListener("change", () => input.files[0] && this.handle(input.files[0]));
    for (const ev of ["dragenter", "dragover"]) drop.addEventListener(ev, (e) => { e.preventDefault(); drop.classList.add("over"); });
    for (const ev of ["dragleave", "drop"]) drop.addEventListener(ev, () => drop.classList.remove("over"));
    // a file dropped anywhere on the page is taken too (the browser would otherwise leave the page to open it)
    window.addEventListener("dragover", (e) => e.preventDefault());
    window.addEventListener("drop", (e) => {
      e.preventDefault();
      const f = e.dataTransfer && e.dataTransfer.files[0];
      if (f) this.handle(f);
    });
    for (const b of this.ui.downloads) b.addEventListener("click", () => this.download(b.dataset.format));
    audio.addEventListener("play", () => this.follow());
    audio.addEventListener("seeking", () => { if (!this.ourSeek) this.stopAt = null; this.ourSeek = false; });
    audio.addEventListener("error", () => {
      if (audio.getAttribute("src")) showError(this.ui.error, new PageError(
        "This browser cannot play this file's audio; the transcript below is unaffected.", "playback"));
    });
  }

  /** The server's limits (from /status): the size hint, and the check before an upload. */
  setLimits(limits) {
    this.limitBytes = limits ? limits.max_upload_mb * 1024 * 1024 : null;
    this.ui.limit.textContent = limits ? `up to ${limits.max_upload_mb} MB, ${clock(limits.max_audio_s, 0)} of audio` : "";
  }

  async handle(file) {
    if (this.busy) return;
    showError(this.ui.error, null);
    try {
      this.check(file);
      this.busy = true;
      const reply = await this.send(file);
      this.show(file, reply);
    } catch (e) {
      this.ui.result.hidden = !this.result;
      showError(this.ui.error, e instanceof PageError ? e : new PageError(`Something went wrong: ${e.message || e}`));
    } finally {
      this.busy = false;
      this.ui.progress.hidden = true;
      this.ui.input.value = "";
    }
  }

  check(file) {
    if (file.size === 0) throw new PageError(`"${file.name}" is empty (0 bytes).`, "empty_audio");
    if (this.limitBytes !== null && file.size > this.limitBytes) {
      const mb = (n) => (n / 1024 / 1024).toFixed(1);
      throw new PageError(`"${file.name}" is too large: ${mb(file.size)} MB, and this server accepts up to ` +
        `${mb(this.limitBytes)} MB (flashasr serve --max-upload-mb).`, "file_too_large");
    }
  }

  form(file) {
    const f = new FormData();
    f.append("file", file, file.name);
    f.append("response_format", "verbose_json");
    f.append("timestamp_granularities[]", "segment");
    if (this.ui.words.checked) f.append("timestamp_granularities[]", "word");
    const lang = this.ui.language.value;
    if (lang) f.append("language", lang);
    return f;
  }

  /** Upload (again after a key prompt on 401); resolves with the parsed reply and its timings. */
  async send(file) {
    for (;;) {
      const r = await this.api.upload("/v1/audio/transcriptions", this.form(file), (frac, done) => this.progress(file, frac, done));
      if (r.status === 401) {
        this.ui.progress.hidden = true;
        await this.api.askKey("This server needs an API key to transcribe.");
        continue;
      }
      if (r.status !== 200) throw errorFromBody(r.status, r.text);
      return { ...r, json: JSON.parse(r.text), timing: parseServerTiming(r.header("Server-Timing")) };
    }
  }

  progress(file, frac, done) {
    const { progress, bar, phase } = this.ui;
    progress.hidden = false;
    progress.classList.toggle("busy", done);
    bar.style.width = `${Math.round((frac || 0) * 100)}%`;
    clearInterval(this.timer);
    if (!done) {
      phase.textContent = `Uploading ${file.name}… ${frac === null ? "" : Math.round(frac * 100) + " %"}`;
      return;
    }
    const t0 = performance.now();
    const tick = () => { phase.textContent = `Transcribing… ${((performance.now() - t0) / 1000).toFixed(1)} s`; };
    tick();
    this.timer = setInterval(() => (this.busy ? tick() : clearInterval(this.timer)), 100);
  }

  show(file, reply) {
    clearInterval(this.timer);
    const v = reply.json;
    this.result = { name: file.name.replace(/\.[^.]*$/, "") || "transcript", verbose: v, raw: reply.text };
    const { audio } = this.ui;
    if (audio.dataset.url) URL.revokeObjectURL(audio.dataset.url);
    audio.dataset.url = URL.createObjectURL(file);
    audio.src = audio.dataset.url;
    this.stats(v, reply);
    this.segments(v);
    this.ui.result.hidden = false;
  }

  stats(v, reply) {
    const t = reply.timing;
    const clientMs = reply.doneAt - reply.uploadedAt;
    const serverMs = Number.isFinite(t.total) ? t.total : clientMs;
    const speed = serverMs > 0 ? (v.duration * 1000) / serverMs : null;
    const cell = (value, label) => el("div", { class: "cell" }, el("span", {}, value), el("small", {}, label));
    const detail = Number.isFinite(t.total)
      ? `decode ${ms(t.decode)} · VAD ${ms(t.plan)} · model ${ms(t.transcribe)}`
      : "measured by the browser (no Server-Timing header)";
    const factor = speed === null ? "–" : `${speed >= 100 ? Math.round(speed) : speed.toFixed(1)}×`;
    this.ui.stats.replaceChildren(
      el("div", { class: "cell", id: "file-speed" }, el("span", { class: "big" }, factor),
        el("small", {}, "speed factor: audio seconds per server second")),
      cell(`${v.duration.toFixed(1)} s`, "audio"),
      cell(ms(serverMs), `server: ${detail}`),
      cell(ms(reply.uploadedAt - reply.sentAt), "upload"),
      cell(v.language || "–", `${v.segments.length} segments${v.words ? `, ${v.words.length} words` : ""}`),
    );
  }

  segments(v) {
    const groups = wordsBySegment(v.segments, v.words);
    this.wordEls = [];
    this.segEls = [];
    this.litSeg = { i: -1 };
    this.litWord = { i: -1 };
    const items = v.segments.map((s, i) => {
      const text = wordSpans(s.text.trim(), groups[i], (w, node) => this.wordEls.push({ start: w.start, end: w.end, node }));
      const li = el("li", { dataset: { start: s.start, end: s.end }, onclick: () => this.play(s.start, s.end), title: "play this segment" },
        el("span", { class: "time" }, `${clock(s.start)} → ${clock(s.end)}`), el("span", { class: "text" }, ...text));
      this.segEls.push({ start: s.start, end: s.end, node: li });
      return li;
    });
    this.ui.segments.replaceChildren(...items);
    this.ui.text.hidden = v.segments.length > 0;
    this.ui.text.textContent = v.segments.length ? "" : (v.text.trim() || "(no speech found)");
  }

  play(start, end) {
    const { audio } = this.ui;
    this.ourSeek = true;
    audio.currentTime = start;
    this.stopAt = end;
    audio.play().catch((e) => showError(this.ui.error, new PageError(`Playback failed: ${e.message}`, "playback")));
  }

  /** While playing: light the current segment and word; stop at the end of a clicked segment. */
  follow() {
    cancelAnimationFrame(this.raf);
    const { audio } = this.ui;
    const step = () => {
      const t = audio.currentTime;
      if (this.stopAt !== null && t >= this.stopAt) { audio.pause(); this.stopAt = null; }
      mark(this.segEls, t, this.litSeg);
      mark(this.wordEls, t, this.litWord);
      if (!audio.paused && !audio.ended) this.raf = requestAnimationFrame(step);
    };
    this.raf = requestAnimationFrame(step);
  }

  download(format) {
    if (!this.result) return;
    const d = DOWNLOADS[format];
    saveFile(`${this.result.name}.${format}`, d.render(this.result.verbose, this.result.raw), d.mime);
  }
}

/**
 * The segment's text with each of its words (in order) wrapped in a span: the text stays exactly
 * the server's (punctuation and spacing kept); a word not found in it is left unmarked.
 */
export function wordSpans(text, words, register) {
  const out = [];
  const lower = text.toLowerCase();
  let pos = 0;
  for (const w of words) {
    const token = w.word.trim();
    const i = token ? lower.indexOf(token.toLowerCase(), pos) : -1;
    if (i < 0) continue;
    if (i > pos) out.push(text.slice(pos, i));
    const node = el("span", { class: "word" }, text.slice(i, i + token.length));
    register(w, node);
    out.push(node);
    pos = i + token.length;
  }
  if (pos < text.length) out.push(text.slice(pos));
  return out;
}

/** Class "current" on the item of `list` ({start, end, node}, sorted by start) that holds time `t`;
 * `state.i` remembers the lit one, so a frame costs a binary search and two class changes. */
function mark(list, t, state) {
  let lo = 0, hi = list.length - 1, at = -1;
  while (lo <= hi) { // the last item starting at or before t
    const mid = (lo + hi) >> 1;
    if (list[mid].start <= t) { at = mid; lo = mid + 1; } else hi = mid - 1;
  }
  if (at >= 0 && t >= list[at].end) at = -1;
  if (at === state.i) return;
  if (state.i >= 0 && list[state.i]) list[state.i].node.classList.remove("current");
  if (at >= 0) list[at].node.classList.add("current");
  state.i = at;
}
