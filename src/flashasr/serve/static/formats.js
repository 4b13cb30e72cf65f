// Transcript downloads, rendered from the verbose_json reply exactly as the server renders them
// (flashasr/formats.py: text, srt, vtt; json is the verbose_json body as received), so a download
// equals what the API returns for response_format=text/srt/vtt.

function ts(seconds, sep) {
  let t = Math.round(Math.max(seconds, 0) * 1000);
  const h = Math.floor(t / 3600000); t -= h * 3600000;
  const m = Math.floor(t / 60000); t -= m * 60000;
  const s = Math.floor(t / 1000); t -= s * 1000;
  const p = (n, w) => String(n).padStart(w, "0");
  return `${p(h, 2)}:${p(m, 2)}:${p(s, 2)}${sep}${p(t, 3)}`;
}

const strip = (s) => (s || "").trim();

export function toText(v) {
  return strip(v.text) + "\n";
}

export function toSrt(v) {
  const cues = v.segments.filter((s) => strip(s.text));
  return cues.map((s, i) => `${i + 1}\n${ts(s.start, ",")} --> ${ts(s.end, ",")}\n${strip(s.text)}\n`).join("\n");
}

export function toVtt(v) {
  const out = ["WEBVTT\n"];
  for (const s of v.segments) if (strip(s.text)) out.push(`${ts(s.start, ".")} --> ${ts(s.end, ".")}\n${strip(s.text)}\n`);
  return out.join("\n");
}

export const DOWNLOADS = {
  txt: { mime: "text/plain", render: (v, raw) => toText(v) },
  srt: { mime: "application/x-subrip", render: (v, raw) => toSrt(v) },
  vtt: { mime: "text/vtt", render: (v, raw) => toVtt(v) },
  json: { mime: "application/json", render: (v, raw) => raw },
};

/** Save `text` as a file named `name` (a temporary link; nothing leaves the browser). */
export function saveFile(name, text, mime) {
  const url = URL.createObjectURL(text instanceof Blob ? text : new Blob([text], { type: `${mime};charset=utf-8` }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
