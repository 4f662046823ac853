"""The built documentation site, opened from disk (file://) in Debian's headless Chromium through selenium.

The strict build (tests/unit/test_docs.py) checks the Markdown's links; this file checks what a reader gets from the
HTML: every link of every page opens a page (the offline plugin names each page's .html file, where a link to a folder
would open a directory listing), the search box answers, and every table fits its page's content area.

It needs Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromedriver``; ``.ci/run`` installs them with
apt-get) and selenium (the ``test`` extra). Without them the tests fail with the command that installs them: a browser
download is not an option, selenium is pointed at Debian's binaries and told not to fetch any.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1280, 900)
"""A laptop's window: Material shows both sidebars from 76.25em (1220 px) on, the narrowest content area of a desktop."""
SEARCH_WORD = "ZeRO"
SEARCH_WAIT_S = 20

_PAGE_FACTS = """
const article = document.querySelector("article.md-content__inner");
const tables = Array.from(article.querySelectorAll("table")).map((table, index) => ({
    index: index,
    header: Array.from(table.querySelectorAll("th")).map(th => th.textContent.trim()).join(" | ").slice(0, 80),
    width: table.scrollWidth,
    shown: table.clientWidth,
}));
const keys = Array.from(article.querySelectorAll("td:first-child > code"))
    .filter(code => code.getClientRects().length > 1).map(code => code.textContent);
return {
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
    content: article.clientWidth,
    tables: tables,
    broken_codes: keys,
};
"""
"""Per page: every link as the browser resolves it, the content area's width, each table's full and shown widths, and
the first-column code spans that wrap over more than one line."""


def _missing_tools() -> list[str]:
    problems = []
    for binary, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not binary.is_file():
            problems.append(f"{binary} is missing (Debian's {package}: apt-get install -y chromium chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        problems.append('selenium is not installed (the test extra: pip install -e ".[test]")')
    return problems


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Debian's chromedriver; fails (never skips) when either or selenium is missing."""
    problems = _missing_tools()
    if problems:
        pytest.fail("the documentation site's browser tests need Debian's Chromium and selenium: "
                    + "; ".join(problems) + ". .ci/run installs them before make test.", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(argument)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SE_OFFLINE", "true")  # selenium's driver manager: use the binaries given, download nothing
        driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def pages(docs_site, browser) -> dict[str, dict]:
    """``{page path in the site: facts}`` for every page of the built site, each opened once from disk (but 404.html,
    which a web server shows, with links from the server's root)."""
    facts = {}
    for html in sorted(set(docs_site.rglob("*.html")) - {docs_site / "404.html"}):
        browser.get(html.as_uri())
        facts[html.relative_to(docs_site).as_posix()] = browser.execute_script(_PAGE_FACTS)
    return facts


def link_problem(url: str, site: Path) -> str | None:
    """Why a link of the site does not open a page of it (None when it does, or when it leaves the site)."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    path = Path(unquote(parts.path))
    if site not in path.parents and path != site:
        return f"{url}: outside the site"
    if path.is_dir():
        return f"{url}: a folder (it opens a directory listing, not a page)"
    if not path.is_file():
        return f"{url}: no such file"
    if parts.fragment and path.suffix == ".html":
        anchor = unquote(parts.fragment)
        if f'id="{anchor}"' not in path.read_text(encoding="utf-8"):
            return f"{url}: no #{anchor} in {path.name}"
    return None


def test_the_site_has_every_page_opened(pages):
    assert "index.html" in pages and "reference/keys.html" in pages and len(pages) > 30


def test_every_link_of_every_page_opens_a_page(pages, docs_site):
    broken = sorted({f"{page}: {problem}" for page, facts in pages.items() for url in facts["links"]
                     if (problem := link_problem(url, docs_site))})
    assert not broken, "links that open no page:\n" + "\n".join(broken)


def test_the_link_check_names_a_folder_and_a_missing_page(docs_site):
    assert "a folder" in link_problem((docs_site / "benchmarks").as_uri(), docs_site)
    assert "no such file" in link_problem((docs_site / "nope.html").as_uri(), docs_site)
    assert "no #nope" in link_problem((docs_site / "training.html").as_uri() + "#nope", docs_site)
    assert link_problem((docs_site / "training.html").as_uri(), docs_site) is None
    assert link_problem("https://example.org/", docs_site) is None


def test_no_table_is_wider_than_its_page(pages):
    wide = [f"{page}: table {t['index']} ({t['header']!r}) is {t['width']} px wide, shows {t['shown']} px, the page's "
            f"content is {facts['content']} px" for page, facts in pages.items() for t in facts["tables"]
            if t["width"] > min(t["shown"], facts["content"])]
    assert not wide, "tables cut off on the right (docs/stylesheets/extra.css wraps the cells):\n" + "\n".join(wide)


def test_key_names_in_the_reference_do_not_wrap(pages):
    facts = pages["reference/keys.html"]
    assert len(facts["tables"]) > 10
    assert not facts["broken_codes"], ("key names broken over two lines (lmrecipe/config/reference.py writes the page): "
                                       + ", ".join(facts["broken_codes"]))


def test_the_search_box_answers_from_disk(docs_site, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get((docs_site / "index.html").as_uri())
    box = WebDriverWait(browser, SEARCH_WAIT_S).until(
        ready.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")),
        f"the search box did not become usable within {SEARCH_WAIT_S} s (its worker did not start from disk)")
    box.click()
    box.send_keys(SEARCH_WORD)
    found = WebDriverWait(browser, SEARCH_WAIT_S).until(
        lambda driver: driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item a[href]"),
        f"no search results for {SEARCH_WORD!r} within {SEARCH_WAIT_S} s")
    targets = [a.get_attribute("href") for a in found]
    assert [problem for url in targets if (problem := link_problem(url, docs_site))] == []
    assert any("parallelism.html" in url or "training.html" in url for url in targets), targets
