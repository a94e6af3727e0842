// Answers as markdown: marked parses, DOMPurify sanitizes (model text is untrusted), highlight.js
// colours code blocks, each of which gets a copy button. The three are vendored in vendor/.

const { marked, DOMPurify, hljs } = window;

// Copy to the clipboard; the fallback serves pages opened over plain http from another machine,
// where navigator.clipboard does not exist.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = Object.assign(document.createElement("textarea"), { value: text });
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

// A button that copies what `text()` returns and says so for two seconds.
export function copyButton(label, text) {
  const button = Object.assign(document.createElement("button"), { type: "button", className: "quiet small copy", textContent: "Copy" });
  button.setAttribute("aria-label", label);
  button.addEventListener("click", async () => {
    try {
      await copyText(text());
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 2000);
  });
  return button;
}

function decorateCode(root, highlight) {
  for (const pre of root.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    if (!code) continue;
    const lang = [...code.classList].find((c) => c.startsWith("language-"))?.slice(9);
    if (highlight && lang && hljs.getLanguage(lang)) hljs.highlightElement(code);
    const bar = document.createElement("div");
    bar.className = "code-bar";
    bar.append(Object.assign(document.createElement("span"), { textContent: lang || "text" }),
      copyButton(`Copy ${lang || "text"} code`, () => code.textContent));
    pre.before(bar);
    const block = document.createElement("div");
    block.className = "code-block";
    bar.before(block);
    block.append(bar, pre);
    pre.tabIndex = 0; // a scrollable region must be reachable from the keyboard
  }
}

// Replace el's content by the rendered markdown; highlighting waits for the finished answer.
export function renderMarkdown(el, text, { highlight = true } = {}) {
  const html = DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: false }));
  const template = document.createElement("template");
  template.innerHTML = html;
  for (const a of template.content.querySelectorAll("a[href]")) {
    a.target = "_blank";
    a.rel = "noopener noreferrer";
  }
  decorateCode(template.content, highlight);
  el.replaceChildren(template.content);
}

// A server's message as text with `backticks` shown as code, never as HTML.
export function inlineCode(text) {
  const frag = document.createDocumentFragment();
  text.split(/`([^`]+)`/).forEach((part, i) => {
    if (!part) return;
    frag.append(i % 2 ? Object.assign(document.createElement("code"), { textContent: part }) : part);
  });
  return frag;
}
