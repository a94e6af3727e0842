// Small DOM helpers shared by the views: element creation, the undo toast, the confirm dialog.

export const $ = (id) => document.getElementById(id);

export function el(tag, props = {}, ...children) {
  const e = Object.assign(document.createElement(tag), props);
  e.append(...children.filter((c) => c !== null && c !== undefined));
  return e;
}

export function button(text, label, onClick, className = "quiet small") {
  const b = el("button", { type: "button", className, textContent: text });
  if (label) b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

let toastTimer = null;

// A message at the bottom of the page, with an optional action (Undo), gone after `seconds`.
export function toast(text, action = null, seconds = 8) {
  const box = $("toast");
  clearTimeout(toastTimer);
  box.replaceChildren(el("span", { textContent: text }));
  if (action) {
    box.append(button(action.label, null, () => {
      box.hidden = true;
      action.run();
    }, "small"));
  }
  box.hidden = false;
  toastTimer = setTimeout(() => { box.hidden = true; }, seconds * 1000);
}

// Resolves true when the user confirms `text` with the `okLabel` button.
export function confirmDialog(text, okLabel) {
  const dialog = $("confirm-dialog");
  $("confirm-text").textContent = text;
  $("confirm-ok").textContent = okLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
  });
}
