// Building the page's elements. Text — above all every text that came from a process or a host — goes in
// through createTextNode / textContent only, never as markup: a process named "<img onerror=...>" is shown as
// those characters. Attributes are set one by one with setAttribute (never a style attribute: the CSP's
// style-src 'self' refuses inline styles; widths go through CSSOM, el.style.width, which it allows).

const SVG_NS = "http://www.w3.org/2000/svg";

function fill(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.setAttribute("class", value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// el("td", {class: "num"}, "12 MiB"): an HTML element; strings among the children become text nodes.
export function el(tag, attrs, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

// svg("rect", {x: 0, width: 10}): an SVG element, its geometry as attributes (CSP-safe).
export function svg(tag, attrs, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

// Replace a node's children (none given: empty it).
export function replace(node, ...children) {
  node.replaceChildren();
  return fill(node, null, children);
}

// A bar of a percentage (0-100, or null: unknown): its width through CSSOM.
// A bar of `percent` with its label; `level` ("light", "moderate", "heavy" from format.js load, or "") colours it.
export function bar(percent, label, level = "") {
  const fillEl = el("span", {class: "bar-fill"});
  const known = typeof percent === "number" && Number.isFinite(percent);
  fillEl.style.width = `${known ? Math.max(0, Math.min(100, percent)) : 0}%`;
  if (known && level) fillEl.classList.add(`load-${level}`);
  return el("span", {class: known ? "bar" : "bar unknown", title: label}, fillEl,
            el("span", {class: "bar-label"}, label));
}

export function $(selector, root = document) {
  return root.querySelector(selector);
}
