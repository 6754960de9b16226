"""JupyterLab as a learner meets it, driven by headless Chromium (selenium): open 00, 02 and 03, run every cell, move
each KV-cache player's slider and check that its picture changes; and open every notebook with a player or a figure
(main path, deep dives, solutions) as it is stored, and check that it shows no error and no broken image.

`make test-browser` runs it, and fails if it cannot; `.ci/run` installs the distribution's `chromium` and
`chromium-driver` first. Elsewhere, without them, the test is skipped. The notebooks are copied to a temporary
folder, so that JupyterLab's autosave never touches the repository's.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import _net
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_tour.ipynb", "02_block_manager.ipynb", "03_scheduler.ipynb"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:
    webdriver = None
MISSING = ", ".join(
    what
    for what, found in (("selenium", webdriver), ("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER))
    if not found
)
if MISSING and os.environ.get("MINIVLLM_REQUIRE_BROWSER") == "1":  # `make test-browser`: a skip would prove nothing
    raise RuntimeError(f"the browser test cannot run: {MISSING} not found (apt-get install chromium chromium-driver)")
pytestmark = [pytest.mark.browser, pytest.mark.skipif(bool(MISSING), reason=f"needs {MISSING}")]

# JavaScript run in the page (JupyterLab exposes its application as `window.jupyterapp` when asked to)
NOTEBOOK_STATE = """
const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!panel || !panel.content || !panel.content.model || !panel.sessionContext.session) return null;
const kernel = panel.sessionContext.session.kernel;
const cells = panel.content.model.cells, state = {kernel: kernel ? kernel.status : null, pending: 0, errors: []};
for (let i = 0; i < cells.length; i++) {
  const cell = cells.get(i);
  if (cell.type !== 'code') continue;
  if (cell.executionCount === null) state.pending += 1;
  for (const out of cell.outputs.toJSON())
    if (out.output_type === 'error') state.errors.push(i + ': ' + out.ename + ': ' + out.evalue);
}
return state;
"""


wait_for = functools.partial(_net.wait_for, interval=0.5)  # (a browser is polled less often)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    "JupyterLab on a copy of the course (notebooks and the figures they read), with windowing off: (url, token)."
    work = tmp_path_factory.mktemp("course")
    shutil.copytree(ROOT / "notebooks", work / "notebooks")
    shutil.copytree(ROOT / "figures", work / "figures")
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, JUPYTER_DATA_DIR=str(work / "data"))  # (its own trust database, runtime files)
    trust = Path(sys.executable).parent / "jupyter-trust"  # what `make lab` does: outputs of a trusted notebook
    subprocess.run(
        [trust, *map(str, (work / "notebooks").glob("*.ipynb"))], env=env, check=True, timeout=120, capture_output=True
    )  # may render widgets (the players) before any cell runs
    token = "minivllm-browser-test"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.port_retries=0",  # (a port taken: exit, and start_server tries another)
        "--ip=127.0.0.1",
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={work}",  # as `make lab`: the notebooks' links to ../figures resolve
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={work / 'settings'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")
    log = work / "jupyterlab.log"
    health = f"/api/status?token={token}"
    server, url = _net.start_server(lambda port: [*cmd, f"--port={port}"], log, 120, health=health, cwd=work, env=env)
    try:
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _net.kill_group(server)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def open_notebook(driver, url: str, token: str, name: str) -> None:
    driver.get(
        f"{url}/lab/tree/notebooks/{name}?reset&token={token}"
    )  # (reset: no tab of the notebook before comes back)
    wait_for(
        lambda: (driver.execute_script(NOTEBOOK_STATE) or {}).get("kernel") == "idle",
        180,
        f"{name}'s kernel to be ready",
    )


def run_all_cells(driver, name: str) -> None:
    "Clear the open notebook's stored outputs, run every cell; fail on an error output."
    driver.execute_script("return window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")

    def finished():
        state = driver.execute_script(NOTEBOOK_STATE)
        assert not state["errors"], f"{name}: a cell failed: {state['errors'][0]}"
        return state["pending"] == 0 and state["kernel"] == "idle"

    wait_for(finished, 600, f"every cell of {name} to run", interval=1.0)


def leave(driver, url: str, token: str) -> None:
    "Save the notebook (so that leaving the page asks nothing) and shut its kernel down."
    driver.execute_async_script(
        "window.jupyterapp.commands.execute('docmanager:save').then(arguments[0], arguments[0])"
    )
    with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=10) as r:
        sessions = json.load(r)
    for session in sessions:
        request = urllib.request.Request(f"{url}/api/sessions/{session['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


def shown_picture(player) -> str | None:
    "The `src` of the frame a player shows (its Stack shows one image at a time)."
    shown = [img.get_attribute("src") for img in player.find_elements(By.CSS_SELECTOR, "img") if img.is_displayed()]
    return shown[0] if len(shown) == 1 else None


def players(driver) -> list:
    "Every KV-cache player of the open notebook: a VBox holding a Play button, a slider and a stack of images."
    panel = driver.execute_script("return window.jupyterapp.shell.currentWidget.node")
    boxes = panel.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output .widget-vbox")
    return [
        b
        for b in boxes
        if b.find_elements(By.CSS_SELECTOR, ".widget-play")
        and b.find_elements(By.CSS_SELECTOR, ".widget-slider")
        and b.find_elements(By.CSS_SELECTOR, "img")
    ]


@pytest.mark.timeout(1500)
def test_the_course_runs_in_jupyterlab_and_its_players_move(lab, browser):
    url, token = lab
    moved = {}
    for name in NOTEBOOKS:
        open_notebook(browser, url, token, name)
        if name != "00_tour.ipynb":  # the stored widget state draws the players before the kernel ran anything
            stored = wait_for(lambda: players(browser), 60, f"the stored players of {name} to show")
            assert all(wait_for(functools.partial(shown_picture, p), 60, "a stored frame") for p in stored)
        run_all_cells(browser, name)
        found = (
            wait_for(lambda: players(browser), 120, f"the players of {name}")
            if name != "00_tour.ipynb"
            else players(browser)
        )
        for player in found:
            browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", player)
            before = wait_for(functools.partial(shown_picture, player), 60, f"a frame shown by a player of {name}")
            handle = player.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
            handle.click()
            handle.send_keys(Keys.ARROW_RIGHT)  # the next snapshot
            wait_for(
                lambda player=player, before=before: shown_picture(player) not in (None, before),
                60,
                f"a player of {name} to change frame",
            )
            moved[name] = moved.get(name, 0) + 1
        leave(browser, url, token)
    assert moved.get("02_block_manager.ipynb", 0) >= 1 and moved.get("03_scheduler.ipynb", 0) >= 1, moved


# every <img> of the open notebook (outputs, players, markdown): [source, loaded, width]
IMAGES = """
const node = window.jupyterapp.shell.currentWidget.node;
return Array.from(node.querySelectorAll('.jp-OutputArea-output img, .jp-RenderedMarkdown img'))
  .map(img => [img.src.slice(0, 80), img.complete, img.naturalWidth]);
"""


# the notebook at arguments[0] is loaded, drawn and the current tab (made so if a tab restored later took the focus)
LOADED_PATH = """
const shell = window.jupyterapp.shell;
for (const panel of shell.widgets('main')) {
  if (!panel.context || panel.context.path !== arguments[0]) continue;
  if (!panel.context.isReady || !panel.content || !panel.content.widgets.length) return false;
  if (shell.currentWidget !== panel) shell.activateById(panel.id);
  return shell.currentWidget === panel;
}
return false;
"""


# the error outputs the open notebook stores (cell index: name: value)
STORED_ERRORS = """
const cells = window.jupyterapp.shell.currentWidget.content.model.cells, errors = [];
for (let i = 0; i < cells.length; i++)
  for (const out of cells.get(i).type === 'code' ? cells.get(i).outputs.toJSON() : [])
    if (out.output_type === 'error') errors.push(i + ': ' + out.ename + ': ' + out.evalue);
return errors;
"""


def stored_pictures(path: Path) -> int:
    "The PNG outputs and widget views a notebook stores, and the images its markdown shows."
    cells = json.loads(path.read_text())["cells"]
    outputs = [o.get("data", {}) for c in cells for o in c.get("outputs", [])]
    shown = sum(1 for d in outputs if "image/png" in d or "application/vnd.jupyter.widget-view+json" in d)
    return shown + sum("".join(c["source"]).count("![") for c in cells if c["cell_type"] == "markdown")


def with_pictures() -> list[str]:
    paths = sorted((ROOT / "notebooks").rglob("*.ipynb"))
    return [p.relative_to(ROOT / "notebooks").as_posix() for p in paths if stored_pictures(p)]


# JupyterLab has restored its layout and can open documents
READY = """
const app = window.jupyterapp;
return Boolean(app && app.commands.hasCommand('docmanager:open') && app.shell.isRestored !== false);
"""

# open a notebook in the page as "Notebook (no kernel)" does (no page load, no kernel started), once the layout is
# restored: a tab the restore opens afterwards would otherwise take the focus from it
OPEN_STORED = """
const [path, done] = arguments;
const app = window.jupyterapp;
app.restored.then(() => app.commands.execute('docmanager:open',
  {path, factory: 'Notebook', kernelPreference: {shouldStart: false, shouldReuse: false}}))
  .then(() => done(null), e => done(String(e)));
"""

# close the open notebook unsaved, without asking (it was only looked at)
DISCARD = """
const panel = window.jupyterapp.shell.currentWidget;
panel.context.model.dirty = false;
panel.dispose();
"""


@pytest.mark.timeout(1500)
def test_every_stored_picture_renders(lab, browser):
    url, token = lab
    browser.get(f"{url}/lab?reset&token={token}")
    wait_for(lambda: browser.execute_script(READY), 120, "JupyterLab to be ready")
    checked = []
    for name in with_pictures():
        path = f"notebooks/{name}"
        assert browser.execute_async_script(OPEN_STORED, path) is None
        wait_for(functools.partial(browser.execute_script, LOADED_PATH, path), 120, f"{name} to load")
        errors = browser.execute_script(STORED_ERRORS)
        assert not errors, f"{name}: a stored error output: {errors[0]}"

        def loaded():  # (a broken image is `complete` too, with no width)
            images = browser.execute_script(IMAGES)
            return images if images and all(done for _, done, _ in images) else None

        images = wait_for(loaded, 120, f"the pictures of {name} to load")
        broken = [src for src, done, width in images if not width]
        assert not broken, f"{name}: broken images {broken}"
        checked.append(name)
        browser.execute_script(DISCARD)
    assert "02_block_manager.ipynb" in checked and "13_qwen3_on_gpu.ipynb" in checked, checked
