// MathJax 3 reads this before it loads (docs/_hooks.py adds both scripts to
// every page). pymdownx.arithmatex (generic mode) wraps each formula of the
// Markdown in <span class="arithmatex">\( ... \)</span> or a div with \[ ... \]:
// typeset those and nothing else, so TeX-like text in code stays literal.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
