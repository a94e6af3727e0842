// Conversations kept in this browser (localStorage), and their JSON export/import.
// A conversation: {id, title, named, created, settings: {mode, temperature, max_tokens, system}, turns}.
// A turn: {user, assistant, reasoning, mode, metrics, finish, error}; finish "stopped" is the user's
// own Stop; reasoning: a thinking model's think block ("" for the others).

const STORE = "verity.conversations";
const ACTIVE = "verity.activeConversation";
const LEGACY = "verity.conversation"; // one conversation's turns, before conversations had a list
export const EXPORT_FORMAT = "verity.conversations";

export const DEFAULT_SETTINGS = { mode: "baseline", temperature: 0, max_tokens: 256, system: "" };

const str = (v, fallback = "") => (typeof v === "string" ? v : fallback);
const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const newId = () => `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
const MODES = ["baseline", "joint"];
// every figure of a turn's `metrics` the page shows (metrics.js), each a finite number
const METRIC_NUMBERS = ["prompt_tokens", "completion_tokens", "reused_tokens", "ttft_s", "decode_tps", "cycles",
  "drafted", "accepted", "budget_mean", "rollbacks", "recovery_s"];

export function newConversation(turns = [], settings = DEFAULT_SETTINGS) {
  return { id: newId(), title: "New conversation", named: false, created: Date.now(), settings: { ...settings }, turns };
}

// What reading left out, counted by kind, for the notice the page shows.
export class Skipped {
  constructor() { this.counts = {}; }
  add(what) { this.counts[what] = (this.counts[what] || 0) + 1; }
  get any() { return Object.keys(this.counts).length > 0; }
  toString() {
    return Object.entries(this.counts).map(([what, n]) => `${n} ${what}${n > 1 ? "s" : ""}`).join(", ");
  }
}

// Unreadable storage is set aside under this key (the newest only), never fatal.
export const SET_ASIDE = `${STORE}.unreadable`;

function setAside(raw, why, notices) {
  try {
    localStorage.setItem(SET_ASIDE, raw);
    localStorage.removeItem(STORE);
  } catch {
    // storage refuses writes: the page still starts, with nothing loaded
  }
  notices.push(`Your saved conversations could not be read (${why}); they were set aside in this browser's ` +
    `storage as "${SET_ASIDE}" and the page starts without them.`);
}

function readList(notices) {
  const raw = localStorage.getItem(STORE);
  let list;
  try {
    list = JSON.parse(raw || "null");
  } catch {
    setAside(raw, "not JSON", notices);
    return [];
  }
  if (list !== null && !Array.isArray(list)) {
    setAside(raw, "not a list", notices);
    return [];
  }
  const skipped = new Skipped();
  if (Array.isArray(list)) {
    const out = normalizeAll(list, skipped);
    if (skipped.any) notices.push(`Some saved data could not be read and was left out: ${skipped}.`);
    return out;
  }
  try {
    const legacy = JSON.parse(localStorage.getItem(LEGACY) || "null");
    if (Array.isArray(legacy) && legacy.length) return [autoTitle(newConversation(legacy.map((t) => normalizeTurn(t, skipped)).filter(Boolean)))];
  } catch {
    // an unreadable legacy entry: ignored
  }
  return [];
}

const notices = [];

export const store = {
  list: readList(notices),
  activeId: localStorage.getItem(ACTIVE),
  notices, // what reading storage left out or set aside, for the page to show once
  save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(this.list));
      localStorage.setItem(ACTIVE, this.activeId || "");
    } catch (e) {
      this.notices.push(`Conversations could not be saved in this browser: ${e.message}`);
      document.dispatchEvent(new Event("store-notice"));
    }
  },
  active() {
    let c = this.list.find((x) => x.id === this.activeId);
    if (!c) {
      c = this.list[0] || newConversation();
      if (!this.list.includes(c)) this.list.unshift(c);
      this.activeId = c.id;
    }
    return c;
  },
};

// The title a conversation gets from its first question, until the user renames it.
export function autoTitle(c) {
  if (!c.named && c.turns.length) {
    const first = c.turns[0].user.replace(/\s+/g, " ").trim();
    c.title = first.length > 40 ? `${first.slice(0, 39)}…` : first || "New conversation";
  }
  return c;
}

function normalizeMetrics(mx, skipped) {
  if (mx === null || mx === undefined) return null;
  const ok = mx && typeof mx === "object" && METRIC_NUMBERS.every((k) => num(mx[k]) !== null) && typeof mx.mode === "string";
  if (!ok) {
    skipped.add("unreadable metrics record");
    return null;
  }
  // the known figures checked; any other plain value kept as it is (a newer server's)
  const plain = Object.entries(mx).filter(([, v]) => v === null || ["number", "string", "boolean"].includes(typeof v));
  return { ...Object.fromEntries(plain), draft: typeof mx.draft === "string" ? mx.draft : null };
}

// A turn, field by field: one without its question is left out; an unreadable field is dropped.
function normalizeTurn(t, skipped) {
  if (!t || typeof t !== "object" || typeof t.user !== "string") {
    skipped.add("unreadable turn");
    return null;
  }
  for (const k of ["assistant", "reasoning", "mode", "finish", "error"]) {
    if (t[k] !== undefined && t[k] !== null && typeof t[k] !== "string") skipped.add(`unreadable ${k} field`);
  }
  return { user: t.user, assistant: str(t.assistant), reasoning: str(t.reasoning), mode: MODES.includes(t.mode) ? t.mode : "baseline",
    metrics: normalizeMetrics(t.metrics, skipped),
    finish: typeof t.finish === "string" ? t.finish : (t.error ? null : "stop"), error: typeof t.error === "string" ? t.error : null };
}

function normalizeSettings(given, skipped) {
  const s = given && typeof given === "object" ? given : {};
  if (given !== undefined && s !== given) skipped.add("unreadable settings record");
  const temperature = num(s.temperature);
  const maxTokens = num(s.max_tokens);
  return { mode: MODES.includes(s.mode) ? s.mode : DEFAULT_SETTINGS.mode,
    temperature: temperature !== null && temperature >= 0 && temperature <= 2 ? temperature : DEFAULT_SETTINGS.temperature,
    max_tokens: maxTokens !== null && maxTokens >= 1 ? Math.floor(maxTokens) : DEFAULT_SETTINGS.max_tokens,
    system: str(s.system) };
}

// A conversation as read from storage or a file, with every field of the right type; null if not one.
export function normalize(c, skipped = new Skipped()) {
  if (!c || typeof c !== "object" || !Array.isArray(c.turns)) {
    skipped.add("unreadable conversation");
    return null;
  }
  return {
    id: str(c.id) || newId(), title: str(c.title, "Imported conversation") || "Imported conversation",
    named: Boolean(c.named), created: num(c.created) || Date.now(),
    turns: c.turns.map((t) => normalizeTurn(t, skipped)).filter(Boolean), settings: normalizeSettings(c.settings, skipped),
  };
}

// Every readable conversation of a list, ids made unique.
function normalizeAll(list, skipped) {
  const seen = new Set();
  return list.map((c) => normalize(c, skipped)).filter(Boolean).map((c) => {
    const out = seen.has(c.id) ? { ...c, id: newId() } : c;
    seen.add(out.id);
    return out;
  });
}

export function exportJson(list) {
  return JSON.stringify({ format: EXPORT_FORMAT, version: 1, exported: new Date().toISOString(), conversations: list }, null, 2);
}

// The conversations of an export file, each with a fresh id, and what was left out of them;
// throws a readable error when the file holds none.
export function parseImport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new Error("That file is not JSON. Import takes a file made by Export.");
  }
  if (!data || data.format !== EXPORT_FORMAT || !Array.isArray(data.conversations)) {
    throw new Error(`That file is not a verity export (no "format": "${EXPORT_FORMAT}" with a list of conversations).`);
  }
  const skipped = new Skipped();
  const list = data.conversations.map((c) => normalize(c, skipped)).filter(Boolean);
  if (!list.length) throw new Error(`That export holds no readable conversation${skipped.any ? ` (${skipped})` : ""}.`);
  return { list: list.map((c) => ({ ...c, id: newId() })), skipped };
}
