// What a reader of a built docs page would notice is wrong with its layout, as a list of
// sentences (empty: the page is fine). Evaluated by tests/docs/test_rendering.py in headless
// Chromium after the page's load event; `COMMANDS_FIT` is replaced with true at the desktop width,
// where a shell block must show its widest line without scrolling sideways.
(async () => {
  const commandsFit = COMMANDS_FIT;
  // Two frames: the theme's script has wrapped tables and laid out the page.
  await new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));
  const problems = [];
  // The text column: the theme lets code blocks and table boxes reach into its padding.
  const column = document.querySelector(".md-content") || document.body;
  const edge = column.getBoundingClientRect().right + 1;
  const headings = [...column.querySelectorAll("h1, h2, h3, h4")];
  const where = (el) => {
    let last = "top of the page";
    for (const h of headings) {
      if (h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING) {
        last = `under "${h.textContent.replace("¶", "").trim()}"`;
      }
    }
    return last;
  };
  const snippet = (el) => JSON.stringify(el.textContent.trim().replace(/\s+/g, " ").slice(0, 50));
  const report = (el, what) => problems.push(`${what} (${where(el)}: ${snippet(el)})`);
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const clips = (el) => ["hidden", "clip"].includes(getComputedStyle(el).overflowX);
  // The box that shows `el` within the column when `el` is wider: `el` itself or its nearest
  // ancestor that scrolls sideways (the theme's scroll wrapper) and ends inside the column.
  const scrollBox = (el) => {
    for (let a = el; a && a !== column; a = a.parentElement) {
      if (scrolls(a) && a.getBoundingClientRect().right <= edge) return a;
    }
    return null;
  };

  // Tables and code blocks: either they fit the text column, or they scroll inside a box that
  // does; content cut off by a box that does not scroll is lost to the reader.
  const boxes = [
    ...[...column.querySelectorAll("table")].map((el) => [el, "a table"]),
    ...[...column.querySelectorAll("pre")].map((el) => [el, "a code block"]),
  ];
  for (const [el, kind] of boxes) {
    const rect = el.getBoundingClientRect();
    const contentRight = rect.left + Math.max(el.scrollWidth, rect.width);
    if (contentRight > edge && scrollBox(el) === null) {
      report(el, `${kind} runs ${Math.round(contentRight - edge)} px past the text column`);
    }
    for (const inner of [el, ...el.querySelectorAll("code, td, th")]) {
      if (clips(inner) && inner.scrollWidth > inner.clientWidth + 1) {
        report(inner, `${kind} is cut off without a scroll bar`);
        break;
      }
    }
  }

  // A command or code a reader copies should be seen whole: long lines are broken (a backslash
  // in a shell). Output samples (text, JSON) may scroll.
  if (commandsFit) {
    const shells = column.querySelectorAll(
      [
        "bash", "sh", "shell", "console", "python", "yaml", "toml",
      ].map((language) => `.language-${language} pre > code`).join(", "),
    );
    for (const code of shells) {
      if (code.scrollWidth > code.clientWidth + 1) {
        const longest = code.textContent.split("\n").reduce((a, b) => (b.length > a.length ? b : a));
        problems.push(
          `a command or code block scrolls sideways (${where(code)}): break ${JSON.stringify(
            longest.slice(0, 60),
          )}...`,
        );
      }
    }
  }

  // Names in tables (settings, variables, metrics) must not break in the middle of a word.
  for (const code of column.querySelectorAll("td code, th code")) {
    if (code.getClientRects().length < 2) continue;
    const text = code.firstChild;
    if (!text || text.nodeType !== Node.TEXT_NODE) continue;
    const range = document.createRange();
    let top = null;
    for (let i = 0; i < text.length; i++) {
      range.setStart(text, i);
      range.setEnd(text, i + 1);
      const rect = range.getBoundingClientRect();
      if (rect.height === 0) continue;
      if (top !== null && rect.top > top + 2 && /\w/.test(text.data[i - 1]) && /\w/.test(text.data[i])) {
        report(code, `\`${text.data}\` breaks across lines mid-word`);
        break;
      }
      top = rect.top;
    }
  }

  // Pictures: loaded, and within the column.
  for (const img of column.querySelectorAll("img")) {
    if (!img.complete || img.naturalWidth === 0) {
      problems.push(`a broken image: ${img.getAttribute("src")} (${where(img)})`);
    } else if (img.getBoundingClientRect().right > edge && scrollBox(img) === null) {
      problems.push(`an image runs past the text column: ${img.getAttribute("src")}`);
    }
  }

  // And the page as a whole never scrolls sideways.
  const page = document.documentElement;
  if (page.scrollWidth > page.clientWidth + 1) {
    problems.push(`the page is ${page.scrollWidth - page.clientWidth} px wider than the window`);
  }
  return problems;
})()
