// The chat view: streams POST /v1/chat/completions into the active conversation, renders answers
// as markdown with each one's metrics, and the message actions (copy, edit, regenerate, delete).

import { api, ApiError, sseData } from "./api.js";
import { copyButton, inlineCode, renderMarkdown } from "./markdown.js";
import { figures } from "./metrics.js";
import { autoTitle, store } from "./store.js";
import { $, button, el, toast } from "./ui.js";
import { readSettings, showSettings } from "./settings.js";

let controller = null; // the AbortController of the answer being streamed
let serverDown = null; // why Send is disabled, or null
let following = true; // the view follows the stream only while the user is at the bottom
const ORIGINS = "verity.showDrafts";
const showOrigins = () => localStorage.getItem(ORIGINS) === "1";

// The answer as text spans by origin (the stream's `verity.drafted`), or as markdown.
function paintAnswer(answer, turn, options) {
  const origins = showOrigins() && turn.origins;
  answer.classList.toggle("origins", Boolean(origins));
  if (!origins) return renderMarkdown(answer, turn.assistant, options);
  answer.replaceChildren(...turn.origins.map(([text, drafted]) =>
    el("span", { className: drafted ? "from-draft" : "from-target", textContent: text })));
}

const conv = () => store.active();
export const isBusy = () => controller !== null;
export const stop = () => controller?.abort();

export function changed() {
  autoTitle(conv());
  store.save();
  document.dispatchEvent(new Event("conversations-changed"));
}

// Sent as the conversation so far: answered turns only (failed ones are the user's to retry).
function history(upTo) {
  const system = conv().settings.system.trim();
  const messages = system ? [{ role: "system", content: system }] : [];
  for (const t of conv().turns.slice(0, upTo)) {
    if (t.error || !t.assistant) continue;
    messages.push({ role: "user", content: t.user }, { role: "assistant", content: t.assistant });
  }
  return messages;
}

// What a failure means to the user, in words; the server's own message when it sent one.
function describe(error, answered) {
  if (error instanceof ApiError && error.status) return error.param ? `${error.message} (${error.param})` : error.message;
  if (error instanceof ApiError) return `The answer ended early: ${error.message}.`;
  if (answered) return "The connection to the server broke during the answer.";
  return "Could not reach the server. Check that launch-stack is running, then retry.";
}

function chips(turn) {
  if (turn.metrics) {
    return figures(turn.metrics, turn.finish).map(([k, label, value, tip]) => {
      const chip = el("span", { className: "chip", title: tip }, el("b", { textContent: label }), ` ${value}`);
      chip.dataset.metric = k;
      return chip;
    });
  }
  return turn.finish ? [el("span", { className: "chip", textContent: turn.finish === "stopped" ? "stopped" : turn.finish })] : [];
}

function footer(turn, i) {
  const last = i === conv().turns.length - 1;
  const parts = [];
  if (turn.error) parts.push(el("p", { className: "error" }, inlineCode(turn.error)));
  else if (turn.finish === "stopped") {
    parts.push(el("p", { className: "note" }, turn.assistant ? "Stopped by you." : "Stopped by you before the first token."));
  }
  const actions = el("div", { className: "actions" });
  if (turn.assistant) actions.append(copyButton("Copy answer", () => turn.assistant));
  if (last) {
    const again = turn.error ? button("Retry", "Retry this question", () => regenerate(i), "small needs-server")
      : button("Regenerate", "Regenerate this answer", () => regenerate(i), "quiet small needs-server");
    again.disabled = Boolean(serverDown);
    actions.append(again);
  }
  return el("div", { className: "footer" }, el("div", { className: "metrics" }, ...chips(turn)), ...parts, actions);
}

function userBlock(turn, i) {
  const bubble = el("div", { className: "bubble user", textContent: turn.user });
  const actions = el("div", { className: "actions user-actions" }, copyButton("Copy question", () => turn.user),
    button("Edit", "Edit and resend this question", () => edit(i)),
    button("Delete", "Delete this question and its answer", () => remove(i)));
  return [bubble, actions];
}

// A thinking model's think block: collapsed above the answer ("Thinking…" while it grows).
function thinkingBlock() {
  const text = el("div", { className: "thinking-text" });
  const block = el("details", { className: "thinking", hidden: true }, el("summary", { textContent: "Thinking…" }), text);
  const paint = (turn, done) => {
    block.hidden = !turn.reasoning;
    text.textContent = turn.reasoning || "";
    block.querySelector("summary").textContent = done ? `Thought (${(turn.reasoning || "").length} characters)` : "Thinking…";
  };
  return [block, paint];
}

function renderTurn(turn, i) {
  const li = el("li", { className: "turn" }, ...userBlock(turn, i));
  li.classList.toggle("failed", Boolean(turn.error));
  const [thought, paintThought] = thinkingBlock();
  if (turn.reasoning) paintThought(turn, true);
  const answer = el("div", { className: "bubble assistant" });
  if (turn.assistant) paintAnswer(answer, turn);
  else answer.hidden = true; // no empty (ghost) bubble
  li.append(thought, answer, footer(turn, i));
  return li;
}

// A turn that cannot be drawn says so in its place; the others, and the page, go on.
function safeTurn(turn, i) {
  try {
    return renderTurn(turn, i);
  } catch (e) {
    console.error(e);
    return el("li", { className: "turn" }, el("p", { className: "error", textContent: `This turn could not be shown: ${e.message}` }));
  }
}

export function renderAll() {
  const turns = conv().turns;
  $("turns").replaceChildren(...turns.map(safeTurn));
  $("empty").hidden = turns.length > 0;
  document.body.classList.toggle("busy", isBusy());
}

function scrollToEnd() {
  if (following) $("turns").scrollTop = $("turns").scrollHeight;
}

function streamingView(turn) {
  const li = el("li", { className: "turn" }, el("div", { className: "bubble user", textContent: turn.user }));
  const [thought, paintThought] = thinkingBlock();
  const answer = el("div", { className: "bubble assistant streaming", hidden: true });
  const waiting = el("p", { className: "note waiting", textContent: "Waiting for the first token…" });
  li.append(thought, answer, waiting);
  $("turns").append(li);
  $("empty").hidden = true;
  let queued = false;
  return () => { // repaint at most once a frame
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      if (!turn.assistant && !turn.reasoning) return;
      waiting.remove();
      paintThought(turn, Boolean(turn.assistant));
      if (!turn.assistant) return scrollToEnd();
      answer.hidden = false;
      paintAnswer(answer, turn, { highlight: false });
      scrollToEnd();
    });
  };
}

async function stream(turn, body) {
  const paint = streamingView(turn);
  scrollToEnd();
  const response = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body), signal: controller.signal,
  });
  for await (const chunk of sseData(response)) {
    if (chunk.error) throw ApiError.fromBody(chunk, 200);
    for (const choice of chunk.choices || []) {
      const text = choice.delta?.content || "";
      turn.assistant += text;
      const thought = choice.delta?.reasoning_content ?? choice.delta?.reasoning ?? "";
      if (thought) turn.reasoning = (turn.reasoning || "") + thought;
      if (chunk.verity && text) (turn.origins ||= []).push([text, chunk.verity.drafted.every(Boolean)]);
      if (choice.finish_reason) turn.finish = choice.finish_reason;
    }
    if (chunk.metrics) turn.metrics = chunk.metrics;
    paint();
  }
  if (!turn.finish) throw new ApiError("the server closed the stream without a finish reason");
}

// Ask `text` as turn number `at` (the turns from `at` on are replaced).
export async function send(text, at = conv().turns.length) {
  if (isBusy() || serverDown) return;
  const c = conv();
  const s = readSettings();
  const turn = { user: text, assistant: "", reasoning: "", mode: s.mode, metrics: null, finish: null, error: null };
  const body = { messages: [...history(at), { role: "user", content: text }], mode: s.mode,
    temperature: s.temperature, max_tokens: s.max_tokens, stream: true };
  c.turns.splice(at, c.turns.length - at, turn);
  renderAll();
  controller = new AbortController();
  busy(true);
  try {
    await stream(turn, body);
  } catch (e) {
    if (e.name === "AbortError") turn.finish = "stopped";
    else turn.error = describe(e, turn.assistant !== "");
  } finally {
    controller = null;
    busy(false);
    renderAll();
    scrollToEnd();
    changed();
  }
}

function regenerate(i) {
  send(conv().turns[i].user, i);
}

function remove(i) {
  const c = conv();
  const [gone] = c.turns.splice(i, 1);
  renderAll();
  changed();
  toast("Question and answer deleted.", { label: "Undo", run: () => {
    c.turns.splice(Math.min(i, c.turns.length), 0, gone);
    renderAll();
    changed();
  } });
}

// The question becomes an editable box; saving resends it and drops the turns after it.
function edit(i) {
  const li = $("turns").children[i];
  const box = el("textarea", { className: "edit", value: conv().turns[i].user, rows: 3 });
  box.setAttribute("aria-label", "Edit the question");
  const save = button("Save and send", null, () => send(box.value, i), "small needs-server");
  const cancel = button("Cancel", null, renderAll);
  const note = el("span", { className: "hint", textContent: "Sending drops the answers after this question." });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Escape") renderAll();
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && box.value.trim()) {
      e.preventDefault();
      save.click();
    }
  });
  li.querySelector(".bubble.user").replaceWith(box);
  li.querySelector(".user-actions").replaceChildren(save, cancel, note);
  save.disabled = Boolean(serverDown) || isBusy();
  box.focus();
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("busy", on);
  // focus stays in the composer (a hidden button would drop it to <body>)
  if (!document.activeElement || document.activeElement === document.body || document.activeElement === $("send")) {
    $("prompt").focus();
  }
}

// Send is disabled, with the reason shown, while the server cannot answer.
export function setServerState(reason) {
  serverDown = reason;
  $("send").disabled = Boolean(reason);
  $("send").title = reason ? `Disabled: ${reason}` : "";
  $("composer-note").textContent = reason ? `Send is disabled: ${reason}.` : "";
  document.querySelectorAll("#turns .needs-server").forEach((b) => { b.disabled = Boolean(reason); });
}

function growComposer() {
  const p = $("prompt");
  p.style.height = "auto";
  p.style.height = `${Math.min(p.scrollHeight + 2, Math.round(window.innerHeight * 0.35))}px`;
}

export function showConversation() {
  showSettings(conv().settings);
  renderAll();
  following = true;
  scrollToEnd();
}

export function initChat() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || isBusy() || serverDown) return;
    $("prompt").value = "";
    growComposer();
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("prompt").addEventListener("input", growComposer);
  $("stop").addEventListener("click", stop);
  $("show-drafts").checked = showOrigins();
  $("show-drafts").addEventListener("change", (e) => {
    localStorage.setItem(ORIGINS, e.target.checked ? "1" : "0");
    renderAll();
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && isBusy()) stop();
  });
  $("turns").addEventListener("scroll", () => {
    const t = $("turns");
    following = t.scrollHeight - t.scrollTop - t.clientHeight < 40;
  });
  showConversation(); // after the controls work, whatever the conversation holds
}
