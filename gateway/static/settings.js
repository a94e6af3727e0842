// The settings panel of the active conversation: mode, temperature, max tokens, system message,
// each kept with the conversation and clamped to what the server accepts.

import { store } from "./store.js";
import { $ } from "./ui.js";

const FIELDS = [ // [input id, setting, minimum, the maximum's name]
  ["temperature", "temperature", 0, "the highest temperature"],
  ["max-tokens", "max_tokens", 1, "the server's cap"],
];

// The field's value within [min, max] (integers for max tokens); notes a change beside it.
function clamp(id, min, why) {
  const input = $(id);
  const max = Number(input.max);
  const raw = input.value.trim() === "" ? NaN : Number(input.value);
  let value = Number.isFinite(raw) ? Math.min(max, Math.max(min, raw)) : min;
  if (id === "max-tokens") value = Math.floor(value);
  const note = $(`${id}-note`);
  note.textContent = value === raw ? "" : `${input.value || "(empty)"} is out of range: using ${value} (${value === max ? why : "the minimum"}).`;
  input.value = String(value);
  return value;
}

export function readSettings() {
  const s = store.active().settings;
  for (const [id, key, min, why] of FIELDS) s[key] = clamp(id, min, why);
  s.system = $("system").value;
  const joint = $("mode").querySelector('option[value="joint"]');
  s.mode = $("mode").value === "joint" && !joint.disabled ? "joint" : "baseline";
  return { ...s };
}

export function showSettings(s) {
  $("temperature").value = String(s.temperature);
  $("max-tokens").value = String(s.max_tokens);
  $("system").value = s.system;
  const joint = $("mode").querySelector('option[value="joint"]');
  $("mode").value = s.mode === "joint" && !joint.disabled ? "joint" : "baseline";
  for (const [id] of FIELDS) $(`${id}-note`).textContent = "";
}

export function applyInfo(info) {
  const joint = $("mode").querySelector('option[value="joint"]');
  joint.disabled = !info.joint_available;
  joint.textContent = info.joint_available ? "joint (draft + target)" : "joint (no draft loaded)";
  $("draft").textContent = info.joint_available ? `draft: ${info.draft_id}` : "Start launch-stack with --draft to enable joint mode.";
  if (info.max_tokens_cap) $("max-tokens").max = info.max_tokens_cap;
  showSettings(store.active().settings);
}

export function initSettings() {
  for (const [id, key, min, why] of FIELDS) {
    $(id).addEventListener("change", () => {
      store.active().settings[key] = clamp(id, min, why);
      store.save();
    });
  }
  for (const [id, event] of [["mode", "change"], ["system", "input"]]) {
    $(id).addEventListener(event, () => {
      readSettings();
      store.save();
    });
  }
}
