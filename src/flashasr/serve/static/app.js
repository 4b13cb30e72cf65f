// The page's start: tabs, the API key (asked once when the server needs one), the server panel,
// the File and Live tabs. `window.flashasr` exposes the parts (for the console and the tests).

import { Api, KeyDialog, PageError, el, showError } from "./api.js";
import { FileTab } from "./file.js";
import { LiveTab } from "./live.js";
import { ServerPanel } from "./server.js";

const $ = (id) => document.getElementById(id);

/** Language choices from the model: "auto" (multilingual models, and models the hint does not
 * steer) and the codes it takes. */
function fillLanguages(select, model) {
  const langs = model && model.languages;
  const opts = [];
  if (!langs || model.multilingual) opts.push(el("option", { value: "" }, "auto"));
  for (const code of langs || []) opts.push(el("option", { value: code }, code));
  const keep = select.value;
  select.replaceChildren(...opts);
  if ([...select.options].some((o) => o.value === keep)) select.value = keep;
  select.disabled = opts.length < 2;
}

function tabs() {
  const pairs = [[$("tab-file-btn"), $("tab-file")], [$("tab-live-btn"), $("tab-live")]];
  const show = (which) => {
    for (const [b, p] of pairs) {
      b.setAttribute("aria-selected", String(b === which));
      p.hidden = b !== which;
    }
    history.replaceState(null, "", `#${which.id.split("-")[1]}`); // tab-live-btn -> #live
  };
  for (const [b] of pairs) b.addEventListener("click", () => show(b));
  if (location.hash === "#live") show(pairs[1][0]);
}

function start() {
  const api = new Api(new KeyDialog($("key-dialog")));
  const file = new FileTab(api, {
    drop: $("drop"), input: $("file-input"), language: $("file-language"), words: $("file-words"), limit: $("file-limit"),
    progress: $("file-progress"), bar: $("file-bar"), phase: $("file-phase"), error: $("file-error"),
    result: $("file-result"), stats: $("file-stats"), audio: $("file-audio"), segments: $("file-segments"),
    text: $("file-text"), downloads: [...document.querySelectorAll(".downloads button")],
  });
  const live = new LiveTab(api, {
    mic: $("mic"), commit: $("commit"), vad: $("live-vad"), language: $("live-language"), save: $("live-save"),
    level: $("level"), state: $("live-state"), error: $("live-error"), items: $("live-items"),
    latency: $("live-latency"), chart: $("live-chart"),
  });
  let keyChecked = false;
  const panel = new ServerPanel(api, { info: $("server-info"), banner: $("banner"), conn: $("conn") }, (s) => {
    file.setLimits(s.limits);
    fillLanguages($("file-language"), s.model);
    fillLanguages($("live-language"), s.model);
    $("forget-key").hidden = !api.key;
    if (!keyChecked && s.limits.api_key_required) {
      keyChecked = true;
      api.ensureKey().then(() => { $("forget-key").hidden = !api.key; });
    }
  });
  $("forget-key").addEventListener("click", () => { api.forgetKey(); $("forget-key").hidden = true; keyChecked = false; });
  tabs();
  window.flashasr = { api, file, live, panel };
  $("boot").hidden = true;
  panel.poll();
}

window.addEventListener("unhandledrejection", (e) => {
  const box = $("banner");
  showError(box, e.reason instanceof PageError ? e.reason : new PageError(`Unexpected error: ${(e.reason && e.reason.message) || e.reason}`));
});

try {
  start();
} catch (e) {
  const box = $("boot");
  box.hidden = false;
  box.textContent = `The page failed to start: ${e.message || e}`;
}
