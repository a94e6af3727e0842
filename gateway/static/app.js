// Boot: views by URL hash, server status, what the server offers (GET /v1/verity/info).

import { api, askForKey, hasKey } from "./api.js";
import { initChat, setServerState } from "./chat.js";
import { initAllocation } from "./allocation.js";
import { applyInfo, initSettings } from "./settings.js";
import { initSidebar, showNotices } from "./sidebar.js";
import { $, toast } from "./ui.js";

const VIEWS = ["chat", "allocation"];

function showView() {
  const name = VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
  for (const v of VIEWS) $(v).hidden = v !== name;
  document.querySelectorAll("nav a").forEach((a) => {
    if (a.dataset.view === name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  });
  window.scrollTo(0, 0); // the header stays in view
}

function setStatus(state, text) {
  if ($("status").textContent === text) return; // a live region: announce changes only
  $("status").dataset.state = state;
  $("status").textContent = text;
}

// /health needs no key: it says whether the worker is ready.
async function pollHealth() {
  try {
    const r = await fetch("/health");
    const h = await r.json();
    if (r.ok) {
      setStatus("ok", "ready");
      setServerState(null);
    } else {
      const why = h.status === "draining" ? "the server is shutting down" : "the worker is starting";
      setStatus("down", h.status === "draining" ? "shutting down" : "worker starting…");
      setServerState(why);
    }
  } catch {
    setStatus("down", "server unreachable");
    setServerState("the server is unreachable (is launch-stack running?)");
  }
}

async function loadInfo() {
  for (;;) {
    try {
      const info = await (await api("/v1/verity/info")).json();
      if (info.ready) {
        $("model").textContent = info.model + (info.draft_id ? ` · draft ${info.draft_id}` : "");
        applyInfo(info);
        $("key-button").hidden = !hasKey();
        return;
      }
    } catch {
      // not reachable yet: retry below
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

// Each part starts on its own: one that fails leaves the others working, and says so.
function start(name, init) {
  try {
    init();
  } catch (e) {
    console.error(e);
    toast(`Part of the page (${name}) failed to start: ${e.message}`, null, 20);
  }
}

window.addEventListener("hashchange", showView);
showView();
start("settings", initSettings);
start("chat", initChat);
start("conversations", initSidebar);
start("allocation", initAllocation);
showNotices();
$("key-button").addEventListener("click", () => askForKey("Enter the API key to use from now on."));
pollHealth();
setInterval(pollHealth, 3000);
loadInfo();
