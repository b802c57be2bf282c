"""End to end in a real browser: JupyterLab on loopback with a token, the explorer notebook
opened in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright), all cells run,
a control changed, the figure redrawn. Screenshots go to .artifacts/browser/ (or
$SPECLAB_ARTIFACTS). Everything started here is stopped here."""

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import papermill as pm
import psutil
import pytest

from speclab.profiles import REPO

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("SPECLAB_CHROMIUM", "/usr/bin/chromium")
RUNS = [REPO / "data" / "runs" / "tiny-cpu", REPO / "data" / "runs" / "h200-dsv4-dial-20261130"]
ARTIFACTS = Path(os.environ.get("SPECLAB_ARTIFACTS", REPO / ".artifacts")) / "browser"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def lab(tmp_path):
    """JupyterLab serving a folder with the explorer notebook parameterized for the committed
    runs; yields (url, token); stops the server and its kernels afterwards."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: apt-get install chromium (see README)"
    for run in RUNS:
        assert any((run / "points").glob("*.parquet")), f"committed results missing: {run}"
    root = tmp_path / "lab"
    root.mkdir()
    pm.execute_notebook(REPO / "notebooks" / "04_explorer.ipynb", root / "explorer.ipynb",
                        parameters={"run_dir": str(RUNS[0]), "runs": [str(r) for r in RUNS[1:]]},
                        prepare_only=True)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    log = open(tmp_path / "jupyter.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, \
                    (tmp_path / "jupyter.log").read_text()[-3000:]
                time.sleep(0.5)
        yield url, token, proc
    finally:
        family = [proc.pid] + [c.pid for c in _children(proc.pid)]
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
        deadline = time.time() + 15
        while (alive := [p for p in family if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]) \
                and time.time() < deadline:
            time.sleep(0.5)
        for p in alive:
            psutil.Process(p).kill()
        assert not alive, f"processes left behind: {alive}"


def _children(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_explorer_redraws_when_a_control_changes(lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    url, token, server = lab
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1100})
        try:
            page.goto(f"{url}/lab/tree/explorer.ipynb?token={token}&reset")
            page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
            try:  # JupyterLab may ask which kernel to start: the notebook's own
                page.get_by_role("button", name="Select", exact=True).click(timeout=10_000)
            except PlaywrightTimeout:
                pass
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            title = page.locator(".speclab-slice")
            title.wait_for(timeout=120_000)
            image = page.locator("img.widget-image")
            expect(image).to_have_attribute("src", re.compile("^blob:"))
            assert server.poll() is None
            first_title, first_png = title.inner_text(), image.screenshot()
            assert RUNS[0].name in first_title and "k=4" in first_title
            assert "AL " in page.locator(".speclab-summary").inner_text()
            page.screenshot(path=ARTIFACTS / "01_default_slice.png", full_page=True)

            k = page.locator(".widget-dropdown", has=page.get_by_text("k", exact=True))
            k.locator("select").select_option(label="1")
            expect(title).to_contain_text("k=1", timeout=60_000)
            page.wait_for_timeout(500)  # the image follows the title in the same update
            second_png = image.screenshot()
            assert second_png != first_png, "the figure did not change with k"
            page.screenshot(path=ARTIFACTS / "02_k1.png", full_page=True)

            # side by side: add the second run in the picker
            picker = page.locator(".widget-select-multiple select").first
            picker.select_option([r.name for r in RUNS])
            expect(title).to_contain_text(RUNS[1].name, timeout=60_000)
            expect(page.locator(".speclab-summary")).to_contain_text(RUNS[1].name)
            page.wait_for_timeout(500)
            assert image.screenshot() != second_png
            page.screenshot(path=ARTIFACTS / "03_two_runs.png", full_page=True)
        except Exception:
            page.screenshot(path=ARTIFACTS / "failure.png", full_page=True)
            raise
        finally:
            browser.close()
