// The budget allocation view. The functions are worker/scheduler/allocation.py's, line for line:
// same operations in the same order, so the same doubles, the same tie keys and the same ranking.

export const PRESET = [[0.95, 0.9, 0.85], [0.8, 0.6, 0.4], [0.6, 0.5, 0.3]]; // docs/design.md's worked example

// s[j] = a[1]·…·a[j]: the chance that draft position j is reached and accepted.
export function survivals(acceptance) {
  const out = [];
  let s = 1.0;
  for (const a of acceptance) {
    s *= a;
    out.push(s);
  }
  return out;
}

// Scores equal to this many decimal places are ties: 0.7 * 0.7 (0.48999999999999994) ties 0.49.
export const TIE_DECIMALS = 9;

// The score as ranked: s rounded half up to TIE_DECIMALS places, as an integer.
export const tieKey = (s) => Math.floor(s * 10 ** TIE_DECIMALS + 0.5);

// All (request, position) candidates, positions 1-based, by survival descending;
// scores equal to TIE_DECIMALS places go by request order, then position.
export function rank(survival) {
  const cands = [];
  survival.forEach((row, r) => row.forEach((s, j) => cands.push([tieKey(s), r, j + 1])));
  cands.sort((x, y) => (y[0] - x[0]) || (x[1] - y[1]) || (x[2] - y[2]));
  return cands.map(([, r, j]) => [r, j]);
}

// Draft length per request for a total budget: the top `budget` candidates, prefix-closed.
export function allocate(survival, budget) {
  const lengths = survival.map(() => 0);
  for (const [r, j] of rank(survival).slice(0, budget)) lengths[r] = Math.max(lengths[r], j);
  return lengths;
}

export const requestName = (r) => (r < 26 ? String.fromCharCode(65 + r) : `R${r + 1}`);

const NUMBER = /^(?:\d+(?:\.\d+)?|\.\d+)$/;
const COMMA_DECIMAL = /(?:^|[\s;,])([01]),(\d+)(?![\d.])/;

// "0.95, 0.9 0.85" -> [0.95, 0.9, 0.85]; throws naming the bad entry
export function parseAcceptance(text, name) {
  const comma = text.match(COMMA_DECIMAL);
  if (comma) {
    throw new Error(`request ${name}: "${comma[1]},${comma[2]}": use a dot as the decimal separator ` +
      `(${comma[1]}.${comma[2]}), and a space or ", " between values`);
  }
  return text.split(/[\s,;]+/).filter(Boolean).map((p) => {
    if (!NUMBER.test(p)) throw new Error(`request ${name}: "${p}" is not a complete number (write it like 0.85)`);
    const a = Number(p);
    if (a > 1) throw new Error(`request ${name}: "${p}" is not a probability in [0, 1]`);
    return a;
  });
}

const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const e = Object.assign(document.createElement(tag), props);
  e.append(...children);
  return e;
};

function addRow(values) {
  const li = el("li", { className: "request" });
  const input = el("input", { type: "text", value: values.join(", "), spellcheck: false, inputMode: "decimal" });
  input.dataset.request = "";
  input.setAttribute("aria-describedby", "requests-help alloc-error");
  input.addEventListener("input", update);
  const remove = el("button", { type: "button", className: "quiet", textContent: "×" });
  remove.addEventListener("click", () => {
    li.remove();
    update();
  });
  li.append(el("label", { className: "name" }), input, remove);
  $("requests").append(li);
}

function setRows(rows) {
  $("requests").replaceChildren();
  rows.forEach(addRow);
  update();
}

// Each request's acceptances; a bad entry is marked (aria-invalid) and the first one's error thrown.
function readInputs() {
  let error = null;
  const rows = [...$("requests").querySelectorAll("li")].map((li, r) => {
    const [label, input, remove] = li.children;
    input.id = `request-${r}`;
    Object.assign(label, { htmlFor: input.id, textContent: requestName(r), title: `acceptance per position, request ${requestName(r)}` });
    remove.setAttribute("aria-label", `remove request ${requestName(r)}`);
    try {
      const row = parseAcceptance(input.value, requestName(r));
      input.removeAttribute("aria-invalid");
      return row;
    } catch (e) {
      input.setAttribute("aria-invalid", "true");
      error = error || e;
      return [];
    }
  });
  if (error) throw error;
  return rows;
}

function update() {
  let acceptance;
  try {
    acceptance = readInputs();
  } catch (e) {
    // never a result computed from a half-typed entry
    $("alloc-error").textContent = e.message;
    $("alloc-results").hidden = true;
    return;
  }
  $("alloc-error").textContent = "";
  $("alloc-results").hidden = false;
  const survival = acceptance.map(survivals);
  const order = rank(survival);
  const total = order.length;
  for (const id of ["budget", "budget-range"]) $(id).max = total;
  const budget = Math.max(0, Math.min(total, Math.floor(Number($("budget").value) || 0)));
  $("budget-range").value = budget;
  $("budget-max").textContent = `of ${total} candidates`;
  const lengths = allocate(survival, budget);
  const rankOf = new Map(order.map(([r, j], i) => [`${r},${j}`, i + 1]));
  renderTable(survival, rankOf, budget);
  $("ranking").replaceChildren(...order.map(([r, j], i) => {
    const li = el("li", { title: `survival ${survival[r][j - 1]}` }, el("b", { textContent: `${requestName(r)}${j}` }),
      ` ${survival[r][j - 1].toFixed(3)}`);
    li.dataset.label = `${requestName(r)}${j}`;
    li.classList.toggle("verified", i < budget);
    return li;
  }));
  $("lengths").dataset.lengths = lengths.join(",");
  $("lengths").replaceChildren(...lengths.map((n, r) => el("span", { className: "chip" },
    el("b", { textContent: requestName(r) }), ` drafts ${n}`)));
  const expected = order.slice(0, budget).reduce((sum, [r, j]) => sum + survival[r][j - 1], 0);
  $("expected").textContent = `Expected tokens from this cycle: ${acceptance.length} (each request's own token) + ` +
    `${expected.toFixed(3)} (sum of the verified survivals). The scheduler picks B by dividing this by the ` +
    "measured cost of such a cycle; that cost needs a running model, so here B is yours to choose.";
}

function renderTable(survival, rankOf, budget) {
  const width = Math.max(0, ...survival.map((row) => row.length));
  const head = el("tr", {}, el("th", { textContent: "request" }),
    ...Array.from({ length: width }, (_, j) => el("th", { textContent: `j = ${j + 1}` })));
  const rows = survival.map((row, r) => el("tr", {}, el("th", { textContent: requestName(r) }),
    ...Array.from({ length: width }, (_, j) => {
      if (j >= row.length) return el("td", { className: "none" });
      const k = rankOf.get(`${r},${j + 1}`);
      const td = el("td", {}, row[j].toFixed(3), el("sup", { textContent: `#${k}` }));
      td.classList.toggle("verified", k <= budget);
      return td;
    })));
  $("survival-table").replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
}

export function initAllocation() {
  $("add-request").addEventListener("click", () => {
    addRow([0.7, 0.5]);
    update();
  });
  $("preset").addEventListener("click", () => setRows(PRESET));
  $("randomize").addEventListener("click", () => setRows(Array.from({ length: 2 + Math.floor(Math.random() * 3) },
    () => Array.from({ length: 1 + Math.floor(Math.random() * 4) }, () => Math.round(Math.random() * 20) / 20))));
  $("budget").addEventListener("input", update);
  $("budget-range").addEventListener("input", () => {
    $("budget").value = $("budget-range").value;
    update();
  });
  setRows(PRESET);
}
