// Conversations kept in this browser (localStorage), and their JSON export/import.
// A conversation: {id, title, named, created, settings: {mode, temperature, max_tokens, system}, turns}.
// A turn: {user, assistant, mode, metrics, finish, error}; finish "stopped" is the user's own Stop.

const STORE = "verity.conversations";
const ACTIVE = "verity.activeConversation";
const LEGACY = "verity.conversation"; // one conversation's turns, before conversations had a list
export const EXPORT_FORMAT = "verity.conversations";

export const DEFAULT_SETTINGS = { mode: "baseline", temperature: 0, max_tokens: 256, system: "" };

const str = (v, fallback = "") => (typeof v === "string" ? v : fallback);
const newId = () => `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;

export function newConversation(turns = [], settings = DEFAULT_SETTINGS) {
  return { id: newId(), title: "New conversation", named: false, created: Date.now(), settings: { ...settings }, turns };
}

function readList() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE) || "null");
    if (Array.isArray(list)) return list.map(normalize).filter(Boolean);
    const legacy = JSON.parse(localStorage.getItem(LEGACY) || "null");
    if (Array.isArray(legacy) && legacy.length) return [autoTitle(newConversation(legacy))];
  } catch {
    // unreadable storage: start afresh
  }
  return [];
}

export const store = {
  list: readList(),
  activeId: localStorage.getItem(ACTIVE),
  save() {
    localStorage.setItem(STORE, JSON.stringify(this.list));
    localStorage.setItem(ACTIVE, this.activeId || "");
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

function normalizeTurn(t) {
  if (!t || typeof t.user !== "string") return null;
  return { user: t.user, assistant: str(t.assistant), mode: str(t.mode, "baseline"),
    metrics: t.metrics && typeof t.metrics === "object" ? t.metrics : null,
    finish: typeof t.finish === "string" ? t.finish : (t.error ? null : "stop"), error: typeof t.error === "string" ? t.error : null };
}

// A conversation as read from storage or a file, with every field of the right type; null if not one.
export function normalize(c) {
  if (!c || !Array.isArray(c.turns)) return null;
  const s = { ...DEFAULT_SETTINGS, ...(c.settings && typeof c.settings === "object" ? c.settings : {}) };
  return {
    id: str(c.id) || newId(), title: str(c.title, "Imported conversation"), named: Boolean(c.named),
    created: Number(c.created) || Date.now(), turns: c.turns.map(normalizeTurn).filter(Boolean),
    settings: { mode: str(s.mode, "baseline"), temperature: Number(s.temperature) || 0,
      max_tokens: Number(s.max_tokens) || DEFAULT_SETTINGS.max_tokens, system: str(s.system) },
  };
}

export function exportJson(list) {
  return JSON.stringify({ format: EXPORT_FORMAT, version: 1, exported: new Date().toISOString(), conversations: list }, null, 2);
}

// The conversations of an export file, each with a fresh id; throws a readable error otherwise.
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
  const list = data.conversations.map(normalize).filter(Boolean);
  if (!list.length) throw new Error("That export holds no conversation.");
  return list.map((c) => ({ ...c, id: newId() }));
}
