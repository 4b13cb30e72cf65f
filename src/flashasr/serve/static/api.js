// The server's public API as the page uses it: /status, /v1/models, uploads (XHR, for upload
// progress), the /v1/realtime WebSocket URL and subprotocols, and the API key (asked once, kept
// in localStorage). Errors are thrown as PageError with a message a person can act on.

const KEY_STORE = "flashasr.apiKey";

/** An error to show to the person: `message`, and the server's error `code` when there is one. */
export class PageError extends Error {
  constructor(message, code = null, status = null) {
    super(message);
    this.code = code;
    this.status = status;
  }
}

/** OpenAI's error JSON `{"error": {message, code}}` (or any other body) -> PageError. */
export function errorFromBody(status, text) {
  try {
    const e = JSON.parse(text).error;
    if (e && e.message) return new PageError(e.message, e.code || null, status);
  } catch (_) { /* not JSON */ }
  const what = status === 413 ? "the file is too large for this server" : `the server answered HTTP ${status}`;
  return new PageError(`Request failed: ${what}.`, null, status);
}

export class Api {
  constructor(keyDialog) {
    this.dialog = keyDialog;
    this.key = null;
    try { this.key = localStorage.getItem(KEY_STORE); } catch (_) { /* storage off */ }
    this.keyRequired = false;
    this._asking = null;
  }

  headers() {
    return this.key ? { Authorization: `Bearer ${this.key}` } : {};
  }

  /** GET /status (open, no key). Throws PageError when the server cannot be reached. */
  async status() {
    let r;
    try {
      r = await fetch("/status", { cache: "no-store" });
    } catch (_) {
      throw new PageError("The server cannot be reached (stopped, restarting, or the network is down).", "server_gone");
    }
    if (!r.ok) throw errorFromBody(r.status, await r.text());
    const s = await r.json();
    this.keyRequired = !!(s.limits && s.limits.api_key_required);
    return s;
  }

  /** Ask for the key (once at a time), store it, resolve with it. */
  askKey(why) {
    if (this._asking) return this._asking;
    this._asking = this.dialog.ask(why).then((key) => {
      this.key = key;
      try { localStorage.setItem(KEY_STORE, key); } catch (_) { /* storage off: kept for this page */ }
      this._asking = null;
      return key;
    });
    return this._asking;
  }

  forgetKey() {
    this.key = null;
    try { localStorage.removeItem(KEY_STORE); } catch (_) { /* storage off */ }
  }

  /** With a key required: ask for one if none is stored, and check it (GET /v1/models) until it works. */
  async ensureKey() {
    if (!this.keyRequired) return;
    if (!this.key) await this.askKey("This server needs an API key.");
    for (;;) {
      let r;
      try {
        r = await fetch("/v1/models", { headers: this.headers(), cache: "no-store" });
      } catch (_) {
        return; // the server panel reports a server that is gone
      }
      if (r.status !== 401) return;
      await this.askKey("The server did not accept that key. Enter it again.");
    }
  }

  /**
   * POST a multipart form with upload progress. Resolves with {status, text, headers(name),
   * sentAt, uploadedAt, doneAt} (performance.now() times); rejects with PageError when the
   * server cannot be reached.
   */
  upload(url, form, onProgress) {
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      const times = { sentAt: performance.now(), uploadedAt: null };
      xhr.open("POST", url);
      for (const [k, v] of Object.entries(this.headers())) xhr.setRequestHeader(k, v);
      xhr.upload.onprogress = (e) => onProgress(e.lengthComputable ? e.loaded / e.total : null, false);
      xhr.upload.onload = () => { times.uploadedAt = performance.now(); onProgress(1, true); };
      xhr.onerror = () => reject(new PageError(
        "The upload failed: the server closed the connection or cannot be reached.", "server_gone"));
      xhr.onload = () => resolve({
        status: xhr.status, text: xhr.responseText, header: (n) => xhr.getResponseHeader(n),
        sentAt: times.sentAt, uploadedAt: times.uploadedAt || performance.now(), doneAt: performance.now(),
      });
      xhr.send(form);
    });
  }

  /** The /v1/realtime URL and subprotocols; the key travels as a subprotocol (or ?api_key=). */
  realtime(sampleRate) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    let url = `${scheme}//${location.host}/v1/realtime?sample_rate=${sampleRate}`;
    const protocols = ["realtime"];
    if (this.key) {
      if (/^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/.test(this.key)) protocols.push(`openai-insecure-api-key.${this.key}`);
      else url += `&api_key=${encodeURIComponent(this.key)}`;
    }
    return { url, protocols };
  }
}

/** The key dialog: `ask(why)` resolves with the entered key. */
export class KeyDialog {
  constructor(dialog) {
    this.dialog = dialog;
    this.input = dialog.querySelector("#key-input");
    this.why = dialog.querySelector("#key-why");
    this.resolve = null;
    dialog.querySelector("#key-form").addEventListener("submit", () => {
      const v = this.input.value.trim();
      if (v && this.resolve) { this.resolve(v); this.resolve = null; }
    });
    dialog.addEventListener("cancel", (e) => e.preventDefault()); // the key is needed to go on
  }

  ask(why) {
    this.why.textContent = why;
    this.input.value = "";
    if (!this.dialog.open) this.dialog.showModal();
    this.input.focus();
    return new Promise((resolve) => { this.resolve = resolve; });
  }
}

// ------------------------------------------------------------------ small DOM and text helpers
/** `el("li", {class: "x", dataset: {a: 1}, onclick: f}, child, "text")` */
export function el(tag, attrs = {}, ...children) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") n.className = v;
    else if (k === "dataset") Object.assign(n.dataset, v);
    else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
    else n.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) n.append(c);
  return n;
}

/** Show a PageError (or any error) in a message box; hide it with null. */
export function showError(box, err) {
  box.replaceChildren();
  if (!err) { box.hidden = true; return; }
  box.append(err.message || String(err));
  if (err.code) box.append(" ", el("span", { class: "code" }, `(${err.code})`));
  box.hidden = false;
}

/** 83.456 -> "01:23.4" (hours when needed). */
export function clock(seconds, digits = 1) {
  const s = Math.max(0, seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const rest = (s % 60).toFixed(digits).padStart(digits ? 3 + digits : 2, "0");
  return (h ? `${h}:${String(m).padStart(2, "0")}` : String(m).padStart(2, "0")) + ":" + rest;
}

export function ms(v) {
  return v === null || v === undefined ? "–" : v >= 10000 ? `${(v / 1000).toFixed(1)} s` : `${Math.round(v)} ms`;
}

/** Nearest-rank percentile of a list of numbers (null when empty). */
export function percentile(values, q) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b);
  return s[Math.max(0, Math.ceil(q * s.length) - 1)];
}
