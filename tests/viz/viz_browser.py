"""Headless Chromium through WebDriver for the visualizer tests; skips when it is missing.

Install: ``apt-get install -y chromium chromium-driver`` (Debian) and ``pip install selenium``
(in the ``test`` extra). ``.ci/run`` installs Chromium best-effort.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str, str]:
    """(browser binary, chromedriver) or pytest.skip with the reason."""
    browser = os.environ.get("PAGEDKV_CHROMIUM") or next(
        (path for path in map(shutil.which, BROWSER_NAMES) if path), None
    )
    driver = os.environ.get("PAGEDKV_CHROMEDRIVER") or shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip(
            "headless Chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        )
    # An explicit, existing driver keeps selenium from trying to download one.
    for path in (browser, driver):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            pytest.skip(f"{path} is not an executable file")
    return browser, driver


def start_chromium(width: int, height: int):
    """A headless Chromium WebDriver session whose viewport is exactly width x height CSS px."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = find_browser()
    options = Options()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tempfile.mkdtemp(prefix='pagedkv-chromium-')}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as error:  # a broken install is an environment problem, not a page bug
        pytest.skip(f"headless Chromium did not start: {error}")
    set_viewport(driver, width, height)
    return driver


def set_viewport(driver, width: int, height: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
    )


def screenshot(driver, name: str) -> Path:
    """Save the viewport as a PNG in the temp dir and print its path."""
    out_dir = Path(tempfile.gettempdir()) / "pagedkv-viz-screenshots"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path
