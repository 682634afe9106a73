// pdproxy fleet dashboard: the one DOM builder every panel's script uses (loaded first).
// Attributes are set one by one and "text" goes through textContent, never HTML: a server
// string (a tenant name, an engine's URL) can never become markup.
"use strict";

window.PdproxyDom = Object.freeze({
  el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.append(child);
    return node;
  },
});
