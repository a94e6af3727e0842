// The conversation list: new, switch, rename, delete (with undo), clear (confirmed), export, import.

import { changed, isBusy, showConversation, stop } from "./chat.js";
import { exportJson, newConversation, parseImport, store } from "./store.js";
import { $, button, confirmDialog, el, toast } from "./ui.js";

const phone = () => window.matchMedia("(max-width: 760px)").matches;

function switchTo(id) {
  if (isBusy()) stop();
  if (phone()) $("conversations-panel").open = false; // the drawer closes on a choice
  store.activeId = id;
  store.save();
  showConversation();
  renderList();
}

function rename(li, c) {
  const input = el("input", { type: "text", value: c.title, className: "rename" });
  input.setAttribute("aria-label", "Conversation name");
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (keep && title) Object.assign(c, { title, named: true });
    store.save();
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  li.querySelector(".open").replaceWith(input);
  input.select();
}

function remove(c) {
  const at = store.list.indexOf(c);
  store.list.splice(at, 1);
  if (store.activeId === c.id) {
    if (isBusy()) stop();
    store.activeId = store.list[Math.min(at, store.list.length - 1)]?.id || null;
  }
  store.save();
  showConversation();
  renderList();
  toast(`Deleted “${c.title}”.`, { label: "Undo", run: () => {
    store.list.splice(Math.min(at, store.list.length), 0, c);
    switchTo(c.id);
  } });
}

export function renderList() {
  const active = store.active();
  $("conversations").replaceChildren(...store.list.map((c) => {
    const open = el("button", { type: "button", className: "open", textContent: c.title, title: c.title });
    open.addEventListener("click", () => switchTo(c.id));
    if (c === active) open.setAttribute("aria-current", "true");
    const li = el("li", {}, open);
    li.append(button("Rename", `Rename “${c.title}”`, () => rename(li, c)),
      button("Delete", `Delete “${c.title}”`, () => remove(c)));
    li.classList.toggle("active", c === active);
    return li;
  }));
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

async function importFile(file) {
  try {
    const { list, skipped } = parseImport(await file.text());
    store.list.unshift(...list);
    switchTo(list[0].id);
    const left = skipped.any ? ` Left out what could not be read: ${skipped}.` : "";
    toast(`Imported ${list.length} conversation${list.length > 1 ? "s" : ""}.${left}`, null, skipped.any ? 20 : 8);
  } catch (e) {
    toast(`Import failed: ${e.message}`);
  }
}

async function clear() {
  const c = store.active();
  if (!c.turns.length) return;
  if (!(await confirmDialog(`Clear all ${c.turns.length} turns of “${c.title}”? This cannot be undone.`, "Clear"))) return;
  if (isBusy()) stop();
  c.turns = [];
  changed();
  showConversation();
}

// What reading or saving the store left out or set aside, shown once (a toast stays 20 s).
export function showNotices() {
  if (store.notices.length) toast(store.notices.splice(0).join(" "), null, 20);
}

export function initSidebar() {
  $("new-chat").addEventListener("click", () => {
    const current = store.active();
    if (current.turns.length === 0) return switchTo(current.id); // an empty one is already there
    const c = newConversation([], current.settings);
    store.list.unshift(c);
    switchTo(c.id);
    $("prompt").focus();
  });
  $("export").addEventListener("click", () => download(`verity-conversations-${new Date().toISOString().slice(0, 10)}.json`,
    exportJson(store.list)));
  $("import").addEventListener("change", () => {
    const file = $("import").files[0];
    $("import").value = "";
    if (file) importFile(file);
  });
  $("clear-chat").addEventListener("click", clear);
  document.addEventListener("conversations-changed", renderList);
  document.addEventListener("store-notice", showNotices);
  if (phone()) {
    for (const id of ["conversations-panel", "settings-panel"]) $(id).open = false;
  }
  renderList();
}
