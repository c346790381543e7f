"""A real browser for the dashboard's tests and bench: Debian's headless chromium driven through Selenium with
Debian's chromedriver (no browser downloaded, none of Selenium Manager's). It only reaches TCP, so the server
it opens listens with `--tcp 127.0.0.1:PORT`; it gets in through a one-time login link (POST /login/link with
the server's bearer token, as the dashboard's login contract gives it), as a person opening `gpukillctl serve
--open`'s link does.

GPUKILL_SCREENSHOTS=DIR: screenshot() writes DIR/NAME.png (docs/screenshots holds the README's); unset, it
writes nothing.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .http_server import Server, request

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# As root (the test suite's user) chromium needs --no-sandbox; no GPU and no /dev/shm on this kind of machine.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-sync",
    "--disable-component-update",
    "--metrics-recording-only",
    "--password-store=basic",
)
WINDOW = (1400, 900)  # the screenshots' size
SCREENSHOTS_ENV = "GPUKILL_SCREENSHOTS"


def why_not() -> str | None:
    """Why no browser test can run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return f"missing {path} (Debian's chromium and chromium-driver: make deps installs them)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


class Browser:
    """One headless chromium; `performance_log`: keep chromium's performance log (network events), for the bench.
    Alerts are left open (unhandledPromptBehavior "ignore") so that a test can find one that fired."""

    def __init__(self, performance_log: bool = False) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
        options.set_capability("unhandledPromptBehavior", "ignore")
        if performance_log:
            options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
        self.profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpukill-chromium-{os.getpid()}-{time.monotonic_ns()}"
        options.add_argument(f"--user-data-dir={self.profile}")  # a profile of its own: no cookie of another run
        self.driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        self.driver.set_page_load_timeout(60)

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)

    # -- getting in ------------------------------------------------------------------------------------

    @staticmethod
    def login_link(server: Server) -> str:
        """A fresh one-time link of a running server (POST /login/link with its bearer token)."""
        r = request(server.target, "POST", "/login/link", token=server.token)
        assert r.status == 200 and isinstance(r.body, dict), r
        return r.body["url"]

    def login(self, server: Server, page: str = "overview", timeout: float = 30.0) -> None:
        """Open the server's one-time link (it sets the cookie and redirects to /), then go to `page` and wait
        until every host's first view is drawn."""
        self.driver.get(self.login_link(server))
        self.open(server, page, timeout)

    def open(self, server: Server, page: str = "overview", timeout: float = 30.0) -> None:
        """Go to `page` (from another page of the same server: a hash change, the stream stays open)."""
        self.driver.get(f"http://{server.host}/#/{page}")
        self.wait(self.ready, timeout, "the page did not become ready (body[data-ready])")
        self.wait(lambda: self.css(f'section[data-page="{page}"]')[0].is_displayed(), 10, f"page {page} not shown")

    # -- looking -------------------------------------------------------------------------------------

    def css(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def ready(self) -> bool:
        return bool(self.driver.execute_script("return document.body && document.body.dataset.ready === '1'"))

    def text(self, selector: str) -> str:
        found = self.css(selector)
        return found[0].text if found else ""

    def wait(
        self, condition: Callable[[], Any], timeout: float, what: str | Callable[[], str], interval: float = 0.05
    ) -> Any:
        """condition() until it is truthy (its value returned); an AssertionError naming `what` past timeout."""
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + timeout
        while True:
            try:
                value = condition()
            except StaleElementReferenceException:  # redrawn under us: ask again
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(what() if callable(what) else what)
            time.sleep(interval)

    def alert_text(self) -> str | None:
        """The text of an alert dialog open now, or None (NoAlertPresentException)."""
        from selenium.common.exceptions import NoAlertPresentException

        try:
            return self.driver.switch_to.alert.text
        except NoAlertPresentException:
            return None

    def screenshot(self, name: str) -> Path | None:
        """DIR/NAME.png where GPUKILL_SCREENSHOTS=DIR is set; else nothing."""
        directory = os.environ.get(SCREENSHOTS_ENV)
        if not directory:
            return None
        path = Path(directory) / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        assert self.driver.save_screenshot(str(path)), f"chromium did not write {path}"
        return path
