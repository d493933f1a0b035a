"""The book in a real browser: `make book-test` runs this file.

Headless Chromium (Debian's ``chromium``) opens every page of the built book (``build/book/html``)
from a local HTTP server, driven over the Chrome DevTools Protocol with ``websocket-client``. A page
fails on: a console error or an uncaught exception; a request that failed or answered >= 400; a
request to any address other than this machine; an image that did not load; a link to a page, file
or anchor of the site that does not exist; mathematics left unrendered (``\\(``, ``\\[``, ``$$`` or
``$...\\cmd...$`` in the visible text, or a MathJax error); a page wider than the window, or a table
or figure wider than the content column outside a scroll container; a figure drawn below
:data:`MIN_FIGURE_SCALE` of its size that does not open at full size; a path of the build machine in
the visible text; and a notebook page whose first 1280 x 800 screen holds no result. Screenshots of
the index and the teaching page are kept in ``build/book/screenshots/``.
``test_the_checker_catches_planted_faults`` shows that each check can fail.

Chromium is started with a proxy on a closed local port and a resolver that finds no host, so a
request for an outside address is seen (and fails) here without any traffic leaving the machine.
Skipped unless ``FISHERKRON_BOOK`` names the built site (``make book-test`` sets it).
"""
from __future__ import annotations

import functools
import http.server
import itertools
import json
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64decode
from pathlib import Path

import pytest

BOOK = Path(os.environ["FISHERKRON_BOOK"]) if os.environ.get("FISHERKRON_BOOK") else None
pytestmark = pytest.mark.skipif(BOOK is None, reason="browser test of the built book: run `make book-test`")
ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "build" / "book" / "screenshots"
TEACHING = "kronecker_fisher_from_scratch.html"
CHROMIUM = os.environ.get("CHROMIUM", "chromium")
PAGE_TIMEOUT_S = 60.0  # load and typeset one page (a loaded 2-core machine takes a few seconds)
LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}
#: the first screen a reader sees (a laptop window): a notebook page's result must start inside it
SCREEN = (1280, 800)
#: a figure drawn at less than this fraction of its pixel size has labels of a few pixels (the
#: notebooks save at 150 dpi with 9-11 pt text) and must open at full size when clicked
MIN_FIGURE_SCALE = 0.45
#: a path of a build machine left in an output (the repository's root, a home folder, a venv)
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:home|root|Users|work|private/var)/[\w.-]+|(?:/[\w.+-]+)+/site-packages/|"
                          + re.escape(str(ROOT)))
#: mathematics MathJax should have replaced, as it would remain in the visible text
RAW_MATH = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\$[^$\n]*\\[A-Za-z]+[^$\n]*\$")

#: what a page reports back once loaded and typeset (run in the page)
PAGE_REPORT_JS = r"""
((MIN_SCALE) => {
  const skip = new Set(["SCRIPT", "STYLE", "NOSCRIPT", "TEXTAREA", "PRE", "CODE"]);
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, {
    acceptNode(node) {
      for (let e = node.parentElement; e; e = e.parentElement) {
        if (skip.has(e.tagName) || e.classList.contains("MathJax_Preview")) return NodeFilter.FILTER_REJECT;
      }
      const p = node.parentElement;
      if (!p || p.getClientRects().length === 0) return NodeFilter.FILTER_REJECT;  // not displayed
      return NodeFilter.FILTER_ACCEPT;
    }});
  const text = [];
  while (walker.nextNode()) text.push(walker.currentNode.nodeValue);
  const content = document.querySelector("article.bd-article, main, article") || document.body;
  const column = content.getBoundingClientRect();
  const scrolls = (e) => {
    for (let a = e.parentElement; a && a !== content.parentElement; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if ((o === "auto" || o === "scroll") && a.getBoundingClientRect().width <= column.width + 1) return true;
    }
    return false;
  };
  const wide = [...content.querySelectorAll("table, img, svg:not(mjx-container svg), iframe")]
    .filter(e => e.getClientRects().length && e.getBoundingClientRect().width > column.width + 1 && !scrolls(e))
    .map(e => `${e.tagName.toLowerCase()} ${Math.round(e.getBoundingClientRect().width)} px ` +
              `(${(e.getAttribute("src") || e.textContent || "").trim().slice(0, 60)})`);
  const small = [...content.querySelectorAll("img")]
    .filter(i => i.complete && i.naturalWidth > 0 && i.getClientRects().length)
    .map(i => ({src: i.currentSrc || i.src, scale: i.getBoundingClientRect().width / i.naturalWidth,
                opens: !!(i.closest("a[href]") && new URL(i.closest("a[href]").href, location.href).href ===
                          new URL(i.currentSrc || i.src, location.href).href)}))
    .filter(i => i.scale < MIN_SCALE && !i.opens);
  const result = document.querySelector(".result");
  return {
    text: text.join(" "),
    allText: document.body.innerText,
    overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,
    wide: wide,
    small: small,
    resultTop: result ? result.getBoundingClientRect().top + window.scrollY : null,
    images: [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0})),
    links: [...document.querySelectorAll("a[href]")].map(a => a.href),
    math: document.querySelectorAll(".math").length,
    typeset: document.querySelectorAll("mjx-container, script[type^='math/tex']").length,
    mathErrors: document.querySelectorAll("[data-mml-node='merror'], mjx-merror, .MathJax_Error, merror").length
                + (document.body.innerText.match(/Math Processing Error/g) || []).length,
  };
})(%s)
""" % MIN_FIGURE_SCALE
#: resolves once MathJax (if the page loads it) has typeset the page: version 3 (the book's) or 2
MATHJAX_DONE_JS = r"""
new Promise(resolve => {
  const wait = (tries) => {
    const mj = window.MathJax;
    if (mj && mj.startup && mj.startup.promise) {
      mj.startup.promise.then(() => resolve("typeset"), () => resolve("failed"));
    } else if (mj && mj.Hub && mj.Hub.Queue) {
      mj.Hub.Queue(() => resolve("typeset"));
    } else if (!document.querySelector("script[src*='mathjax' i]")) {
      resolve("no MathJax");
    } else if (tries > 400) {
      resolve("incomplete");
    } else { setTimeout(() => wait(tries + 1), 50); }
  };
  wait(0);
})
"""


class DevTools:
    """A minimal Chrome DevTools Protocol client over one browser websocket (flat sessions)."""

    def __init__(self, ws_url: str):
        import websocket  # websocket-client

        self.ws = websocket.create_connection(ws_url, timeout=PAGE_TIMEOUT_S, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = PAGE_TIMEOUT_S) -> dict:
        """Send one command and return its result; events that arrive meanwhile are queued."""
        msg_id = next(self.ids)
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.put(reply)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer to {method} within {timeout} s")

    def wait_event(self, method: str, timeout: float = PAGE_TIMEOUT_S) -> list[dict]:
        """Read until event ``method`` arrives; return every event read (that one last)."""
        seen = []
        while not self.events.empty():
            seen.append(self.events.get())
            if seen[-1]["method"] == method:
                return seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                seen.append(msg)
                if msg["method"] == method:
                    return seen
        raise TimeoutError(f"no {method} within {timeout} s")

    def drain(self) -> list[dict]:
        out = []
        while not self.events.empty():
            out.append(self.events.get())
        return out

    def close(self):
        self.ws.close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no line per request on stderr
        pass


@functools.lru_cache(maxsize=None)
def _html_ids(path: Path) -> frozenset[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return frozenset(re.findall(r"""\b(?:id|name)=["']([^"']+)["']""", text))


class Browser:
    """Headless Chromium and a local HTTP server for one folder; :meth:`check` reports one page."""

    def __init__(self, site: Path, workdir: Path):
        self.site = Path(site)
        handler = functools.partial(_QuietHandler, directory=str(self.site))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/"
        profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=workdir))
        binary = shutil.which(CHROMIUM)
        if binary is None:
            raise RuntimeError(f"{CHROMIUM} not found: `make book-test` installs Debian's chromium "
                               "(apt-get install chromium)")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions",
             "--disable-default-apps", "--disable-domain-reliability", "--metrics-recording-only",
             # nothing leaves the machine: outside hosts go to a closed local port and resolve nowhere
             "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=127.0.0.1;localhost",
             "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost",
             f"--window-size={SCREEN[0]},{SCREEN[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{binary} did not start (exit status {self.proc.returncode})")
            time.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        self.cdp = DevTools(f"ws://127.0.0.1:{port}{path}")
        target = self.cdp.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.cdp.send(f"{domain}.enable", session=self.session)
        self.cdp.send("Emulation.setDeviceMetricsOverride", {"width": SCREEN[0], "height": SCREEN[1],
                                                             "deviceScaleFactor": 1, "mobile": False},
                      session=self.session)
        self.cdp.send("Network.setCacheDisabled", {"cacheDisabled": True}, session=self.session)

    def evaluate(self, expression: str, await_promise: bool = False):
        result = self.cdp.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                    "awaitPromise": await_promise}, session=self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, page: str) -> list[dict]:
        """Load ``page`` (a path in the site), wait for its load event and MathJax; the events seen."""
        self.cdp.drain()
        self.cdp.send("Page.navigate", {"url": urllib.parse.urljoin(self.base, page)}, session=self.session)
        events = self.cdp.wait_event("Page.loadEventFired")
        self.mathjax = self.evaluate(MATHJAX_DONE_JS, await_promise=True)
        time.sleep(0.2)  # late console messages
        self.evaluate("0")  # collects the events that arrived meanwhile
        return events + self.cdp.drain()

    def check(self, page: str, notebook: bool = False) -> list[str]:
        """Every problem of ``page``, one line each (empty: the page is fine); a ``notebook`` page
        must also show its result on the first screen."""
        events = self.open(page)
        report = self.evaluate(PAGE_REPORT_JS)
        problems = []
        failed_requests = {}
        for ev in events:
            method, params = ev["method"], ev.get("params", {})
            if ev.get("sessionId") not in (None, self.session):
                continue
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                problems.append(f"console error: {text}")
            elif method == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails", {})
                problems.append(f"uncaught exception: {d.get('exception', {}).get('description', d.get('text'))}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                e = params["entry"]
                problems.append(f"console error ({e.get('source')}): {e.get('text')} {e.get('url', '')}".strip())
            elif method == "Network.requestWillBeSent":
                url = params.get("request", {}).get("url", "")
                failed_requests[params.get("requestId")] = url
                parts = urllib.parse.urlsplit(url)
                if parts.scheme in ("http", "https", "ws", "wss") and parts.hostname not in LOCAL_HOSTS:
                    problems.append(f"request to an outside address: {url}")
                elif parts.scheme not in ("http", "https", "data", "blob", "about", ""):
                    problems.append(f"request with scheme {parts.scheme}: {url}")
            elif method == "Network.responseReceived":
                status = params.get("response", {}).get("status", 0)
                if status >= 400:
                    problems.append(f"HTTP {status}: {params['response'].get('url')}")
            elif method == "Network.loadingFailed" and not params.get("canceled"):
                problems.append(f"request failed ({params.get('errorText')}): "
                                f"{failed_requests.get(params.get('requestId'), '?')}")
        if self.mathjax in ("incomplete", "failed"):
            problems.append(f"MathJax did not finish typesetting ({self.mathjax})")
        problems += [f"broken image: {img['src']}" for img in report["images"] if not img["ok"]]
        problems += self._broken_links(page, report["links"])
        for match in RAW_MATH.finditer(report["text"]):
            lo = max(0, match.start() - 40)
            problems.append(f"unrendered mathematics {match[0][:30]!r}: ...{report['text'][lo:match.end() + 40]}...")
        if report["math"] and not report["typeset"]:
            problems.append(f"{report['math']} math elements but nothing typeset (MathJax: {self.mathjax})")
        if report["mathErrors"]:
            problems.append(f"{report['mathErrors']} MathJax errors")
        if report["overflow"] > 1:
            problems.append(f"the page scrolls sideways: {report['overflow']} px wider than a {SCREEN[0]} px window")
        problems += [f"wider than the content column, outside a scroll container: {w}" for w in report["wide"]]
        problems += [f"figure drawn at {i['scale']:.2f} of its size (labels illegible below "
                     f"{MIN_FIGURE_SCALE}) and not opening at full size: {i['src']}" for i in report["small"]]
        for match in MACHINE_PATH.finditer(report["allText"]):  # outputs (<pre>) included
            lo = max(0, match.start() - 40)
            problems.append(f"a path of the build machine: ...{report['allText'][lo:match.end() + 40]}...")
        if notebook and (report["resultTop"] is None or report["resultTop"] > SCREEN[1] - 80):
            where = "no result block" if report["resultTop"] is None else f"its result starts at {report['resultTop']:.0f} px"
            problems.append(f"the first {SCREEN[0]} x {SCREEN[1]} screen holds no verdict ({where})")
        return sorted(set(problems), key=problems.index)

    def _broken_links(self, page: str, links: list[str]) -> list[str]:
        problems = []
        for href in sorted(set(links)):
            parts = urllib.parse.urlsplit(href)
            if parts.scheme in ("mailto", "javascript", "data"):
                continue
            if not href.startswith(self.base):
                continue  # a link out of the site is not loaded here; requests are checked above
            path = urllib.parse.unquote(parts.path[len(urllib.parse.urlsplit(self.base).path):]) or "index.html"
            target = self.site / path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                problems.append(f"broken link: {href} (no file {path})")
            elif parts.fragment and target.suffix == ".html" and urllib.parse.unquote(parts.fragment) not in _html_ids(target):
                problems.append(f"broken link: {href} (no anchor #{parts.fragment} in {path})")
        return problems

    def screenshot(self, path: Path) -> Path:
        data = self.cdp.send("Page.captureScreenshot", {"format": "png"}, session=self.session)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b64decode(data))
        return path

    def close(self):
        if getattr(self, "cdp", None):
            try:
                self.cdp.send("Browser.close", timeout=10)
            except Exception:  # noqa: BLE001 - the browser may already be gone
                pass
            self.cdp.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.server.shutdown()


def _pages(site: Path | None) -> list[str]:
    if site is None or not site.is_dir():
        return []
    return sorted(str(p.relative_to(site)) for p in site.rglob("*.html")
                  if not p.relative_to(site).parts[0].startswith("_"))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(BOOK, tmp_path_factory.mktemp("browser"))
    yield b
    b.close()


def test_the_book_was_built():
    assert (BOOK / "index.html").is_file(), f"no {BOOK}/index.html: run `make book`"
    names = {p.stem for p in (ROOT / "notebooks").glob("*.py")}
    assert {f"{n}.html" for n in names} <= set(_pages(BOOK)), "a notebook has no page"


NOTEBOOK_PAGES = {f"{p.stem}.html" for p in (ROOT / "notebooks").glob("*.py")}


@pytest.mark.parametrize("page", _pages(BOOK))
def test_page_renders_cleanly(browser, page):
    problems = browser.check(page, notebook=page in NOTEBOOK_PAGES)
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def test_teaching_page_screenshot(browser):
    assert browser.check(TEACHING, notebook=True) == []
    shot = browser.screenshot(SCREENSHOTS / "kronecker_fisher_from_scratch.png")
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    typeset = browser.evaluate("document.querySelectorAll('mjx-container').length")
    assert typeset > 0, "the teaching page shows no typeset mathematics"


def test_index_is_the_results_page(browser):
    """The index lists every paper item with its verdict, and fits the window (screenshot kept)."""
    assert browser.check("index.html") == []
    shot = browser.screenshot(SCREENSHOTS / "index.png")
    assert shot.stat().st_size > 10_000
    text = browser.evaluate("document.body.innerText")
    verdicts = len(re.findall(r"\b(holds in part|holds|not at this scale|cannot tell|does not hold)\b", text))
    assert verdicts >= 19, f"the index shows {verdicts} verdicts for the paper's 19 items"


PLANTED = {
    "console.html": "<script>console.error('planted')</script>",
    "image.html": "<img src='missing.png' alt='x'>",
    "link.html": "<a href='nowhere.html'>x</a> <a href='index.html#no-such-anchor'>y</a>",
    "outside.html": "<img src='http://book-test.invalid/x.png' alt='x'>",
    "math.html": "<p>the factor \\(A \\otimes B\\) and $\\sigma_1$ left raw</p>",
    "index.html": "<p id='here'>fine</p><a href='index.html#here'>ok</a>",
    "wide.html": "<table><tr><td style='white-space:nowrap'>" + "0.23 ± 0.07 " * 300 + "</td></tr></table>",
    "scrolled.html": "<div style='overflow-x:auto'><table><tr><td style='white-space:nowrap'>"
                     + "0.23 ± 0.07 " * 300 + "</td></tr></table></div>",
    "tiny.html": "<img src='big.png' alt='x' style='width:300px'>",
    "opens.html": "<a href='big.png'><img src='big.png' alt='x' style='width:300px'></a>",
    "path.html": "<pre>[PosixPath('/home/someone/fisherkron/figures/fig_x.png')]</pre>",
    "noverdict.html": "<h1>A notebook</h1>" + "<p>parameters</p>" * 60 + "<div class='result'>holds</div>",
    "verdict.html": "<h1>A notebook</h1><div class='result'>holds</div>",
}


def test_the_checker_catches_planted_faults(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    for name, body in PLANTED.items():
        (site / name).write_text(f"<!doctype html><html><head><link rel='icon' href='data:,'></head>"
                                 f"<body>{body}</body></html>", encoding="utf-8")
    _png(site / "big.png", 2000, 400)
    b = Browser(site, tmp_path)
    try:
        found = {name: b.check(name, notebook=name.endswith("verdict.html")) for name in PLANTED}
    finally:
        b.close()
    assert found["index.html"] == []
    assert any(p.startswith("console error: planted") for p in found["console.html"]), found["console.html"]
    assert any(p.startswith("broken image:") for p in found["image.html"]), found["image.html"]
    assert any("no file nowhere.html" in p for p in found["link.html"]), found["link.html"]
    assert any("no anchor #no-such-anchor" in p for p in found["link.html"]), found["link.html"]
    assert any(p.startswith("request to an outside address: http://book-test.invalid/")
               for p in found["outside.html"]), found["outside.html"]
    assert sum(p.startswith("unrendered mathematics") for p in found["math.html"]) >= 2, found["math.html"]
    assert any(p.startswith("the page scrolls sideways") for p in found["wide.html"]), found["wide.html"]
    assert any(p.startswith("wider than the content column") for p in found["wide.html"]), found["wide.html"]
    assert found["scrolled.html"] == []
    assert any(p.startswith("figure drawn at 0.15") for p in found["tiny.html"]), found["tiny.html"]
    assert found["opens.html"] == []
    assert any(p.startswith("a path of the build machine") for p in found["path.html"]), found["path.html"]
    assert any("holds no verdict" in p for p in found["noverdict.html"]), found["noverdict.html"]
    assert found["verdict.html"] == []


def _png(path: Path, width: int, height: int) -> None:
    """A plain grey PNG of the given size (standard library only)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
