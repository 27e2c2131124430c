"""Debian's Chromium driven by selenium, offline: the system chromedriver, never Selenium Manager."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "browser.sh"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--disable-extensions", "--disable-default-apps",
    "--no-default-browser-check", "--metrics-recording-only", "--password-store=basic",
)


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, after trying to install Chromium (root only); else None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install selenium (a dev dependency)"
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return None
    if os.geteuid() == 0 and INSTALL_SCRIPT.exists():
        subprocess.run(["sh", str(INSTALL_SCRIPT)], check=False, timeout=900)
        if CHROMIUM.exists() and CHROMEDRIVER.exists():
            return None
    return (f"{CHROMIUM} or {CHROMEDRIVER} is missing and cannot be installed here (not root, or "
            f"apt failed): run `sudo sh .ci/browser.sh` (apt-get install chromium chromium-driver)")


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A headless Chromium with a fresh profile, performance log on (to see every request)."""
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fedsplit-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def requested_urls(driver: Any) -> list[str]:
    """Every URL the browser requested since the last call (from Chrome's performance log)."""
    import json

    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn on a free loopback port in a thread; yield its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the admin API did not start within 30 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def wait_for(driver: Any, condition: Any, what: str, timeout: float = 15.0) -> None:
    """Wait (bounded) until ``condition(driver)`` holds, ignoring elements not there yet."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout, poll_frequency=0.2,
                  ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                  ).until(condition, message=f"waited for {what}")


def page_text(driver: Any) -> str:
    """The visible text of the page's body."""
    return driver.find_element("tag name", "body").text
