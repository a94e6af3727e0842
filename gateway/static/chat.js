// The chat view: streams POST /v1/chat/completions, keeps the conversation, shows each answer's metrics.

import { api, ApiError, sseData } from "./api.js";

const STORE = "verity.conversation";
const $ = (id) => document.getElementById(id);
let turns = load(); // {user, assistant, mode, metrics, finish, error}
let controller = null; // the AbortController of the answer being streamed

function load() {
  try {
    return JSON.parse(localStorage.getItem(STORE) || "[]");
  } catch {
    return [];
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(turns));
}

const ms = (s) => (s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);

// [metric key, label, value, tooltip] for each figure of the `metrics` object
function figures(mx, finish) {
  const joint = mx.drafted > 0;
  return [
    ["tps", "tokens/s", mx.decode_tps.toFixed(1), "decode speed after the first token"],
    ["ttft", "TTFT", ms(mx.ttft_s), "time to first token, from the worker receiving the request"],
    ["acceptance", "acceptance", joint ? `${mx.accepted}/${mx.drafted} (${Math.round((100 * mx.accepted) / mx.drafted)}%)` : "—",
      "draft tokens the target accepted / draft tokens proposed"],
    ["budget", "budget/cycle", joint ? mx.budget_mean.toFixed(2) : "—", "draft tokens verified per joint cycle"],
    ["reused", "reused", String(mx.reused_tokens), "prompt tokens restored from the cache instead of prefilled"],
    ["tokens", "tokens", `${mx.prompt_tokens} + ${mx.completion_tokens}`, "prompt + generated"],
    ...(joint ? [["recovery", "rollbacks", `${mx.rollbacks} · ${ms(mx.recovery_s)}`, "cycles that rejected a draft token · time to recover state"]] : []),
    ["finish", mx.mode + (mx.draft ? ` · ${mx.draft}` : ""), finish, "mode (draft) and finish reason"],
  ];
}

function renderMetrics(el, turn) {
  el.replaceChildren(...figures(turn.metrics, turn.finish).map(([k, label, value, tip]) => {
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.dataset.metric = k;
    chip.title = tip;
    chip.append(Object.assign(document.createElement("b"), { textContent: label }), ` ${value}`);
    return chip;
  }));
}

function renderTurn(turn) {
  const li = document.createElement("li");
  li.className = "turn";
  const user = Object.assign(document.createElement("div"), { className: "bubble user", textContent: turn.user });
  const answer = Object.assign(document.createElement("div"), { className: "bubble assistant", textContent: turn.assistant });
  const meta = Object.assign(document.createElement("div"), { className: "metrics" });
  li.append(user, answer, meta);
  $("turns").append(li);
  $("empty").hidden = true;
  const view = { li, answer, meta };
  paint(view, turn);
  return view;
}

function paint(view, turn) {
  view.answer.textContent = turn.assistant;
  view.answer.classList.toggle("streaming", !turn.finish && !turn.error);
  view.li.classList.toggle("failed", Boolean(turn.error));
  if (turn.error) {
    const err = Object.assign(document.createElement("p"), { className: "error", textContent: turn.error });
    view.meta.replaceChildren(err);
  } else if (turn.metrics) {
    renderMetrics(view.meta, turn);
  } else if (turn.finish) {
    view.meta.replaceChildren(Object.assign(document.createElement("span"), { className: "chip", textContent: turn.finish }));
  }
  view.li.scrollIntoView({ block: "end" });
}

function history() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }] : [];
  for (const t of turns) {
    if (t.error || !t.finish) continue;
    messages.push({ role: "user", content: t.user }, { role: "assistant", content: t.assistant });
  }
  return messages;
}

async function send(text) {
  const turn = { user: text, assistant: "", mode: $("mode").value, metrics: null, finish: null, error: null };
  const body = {
    messages: [...history(), { role: "user", content: text }],
    mode: turn.mode,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
  };
  turns.push(turn);
  const view = renderTurn(turn);
  controller = new AbortController();
  busy(true);
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal,
    });
    for await (const chunk of sseData(response)) {
      if (chunk.error) throw ApiError.fromBody(chunk, 200);
      for (const choice of chunk.choices || []) {
        turn.assistant += choice.delta?.content || "";
        if (choice.finish_reason) turn.finish = choice.finish_reason;
      }
      if (chunk.metrics) turn.metrics = chunk.metrics;
      paint(view, turn);
    }
    if (!turn.finish) throw new ApiError("the stream ended without a finish_reason");
  } catch (e) {
    if (e.name === "AbortError") {
      turn.finish = "stopped";
      if (!turn.assistant) turn.error = "stopped before the first token";
    } else {
      turn.error = e.param ? `${e.message} (${e.param})` : e.message;
    }
  } finally {
    controller = null;
    busy(false);
    paint(view, turn);
    save();
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
  if (!on) $("prompt").focus();
}

export function applyInfo(info) {
  const joint = $("mode").querySelector('option[value="joint"]');
  joint.disabled = !info.joint_available;
  joint.textContent = info.joint_available ? "joint (draft + target)" : "joint (no draft loaded)";
  if (!info.joint_available && $("mode").value === "joint") $("mode").value = "baseline";
  $("draft").textContent = info.joint_available ? `draft: ${info.draft_id}` : "Start launch-stack with --draft to enable joint mode.";
  if (info.max_tokens_cap) $("max-tokens").max = info.max_tokens_cap;
}

export function initChat() {
  turns.forEach(renderTurn);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => {
    controller?.abort();
    turns = [];
    save();
    $("turns").replaceChildren();
    $("empty").hidden = false;
  });
}
