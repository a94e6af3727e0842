// The server's API as the page uses it: bearer key (asked for on a 401), errors, SSE parsing.

import { inlineCode } from "./markdown.js";

const KEY = "verity.apiKey";
let key = sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
let asking = null; // the pending key dialog, shared by concurrent 401s

export class ApiError extends Error {
  constructor(message, { status = 0, code = null, param = null } = {}) {
    super(message);
    Object.assign(this, { status, code, param });
  }
  static fromBody(body, status) {
    const e = body && body.error;
    if (!e) return new ApiError(`HTTP ${status}`, { status });
    return new ApiError(e.message, { status, code: e.code, param: e.param });
  }
}

export function hasKey() {
  return key !== "";
}

export function askForKey(reason) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-reason").replaceChildren(inlineCode(reason));
  input.value = "";
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      key = input.value.trim();
      const remember = document.getElementById("key-remember").checked;
      sessionStorage.setItem(KEY, key);
      if (remember) localStorage.setItem(KEY, key);
      else localStorage.removeItem(KEY);
      asking = null;
      resolve();
    }, { once: true });
  });
  dialog.showModal();
  input.focus();
  return asking;
}

// fetch with the key; a 401 asks for a key and retries. Non-2xx answers throw ApiError.
export async function api(path, init = {}) {
  for (;;) {
    const headers = { ...(init.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...init, headers });
    if (response.status === 401) {
      const body = await response.json().catch(() => null);
      const why = body?.error?.message || "this server requires an API key";
      await askForKey(key ? `The key was refused: ${why}. Enter the right one.` : `This server requires an API key: ${why}.`);
      continue;
    }
    if (!response.ok) {
      const body = await response.json().catch(() => null);
      throw ApiError.fromBody(body, response.status);
    }
    return response;
  }
}

// The `data:` payloads of a text/event-stream body, in order; stops at [DONE].
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue; // a comment (keep-alive)
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}
