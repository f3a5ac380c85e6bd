"""The interactive layer in a real browser.

JupyterLab is started by the README's first command (``python -m helpers.course lab``), on the loopback
interface only, with a random token; headless Chromium, driven by Selenium, opens
``notebooks/17_config_lab.ipynb``, runs its lab cell, changes the builder (the config and the
calculator's marked row follow), changes the calculator's model (its figures follow), breaks the batch
arithmetic (the checker names it and Launch turns off), launches a short run and waits for its progress,
loss plot and record. Screenshots go to ``docs/images/`` (shown in docs/architecture.md).

Needs Debian's ``chromium`` and ``chromium-driver`` and the pinned ``selenium``; without them the test
is skipped with that reason. ``.ci/run`` installs them and sets ``COURSE_REQUIRE_BROWSER=1``, which
turns such a skip into a failure, so CI cannot pass without the browser having run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers.core import environment

#: Not in the README's test command: `python3 -m helpers.course test --system` (and .ci/run) runs it.
pytestmark = pytest.mark.system

ROOT = environment.REPO_ROOT
IMAGES = ROOT / "docs" / "images"
NOTEBOOK = "17_config_lab.ipynb"
RUN_NAME = "browser-test"
STEPS = 30  # enough optimizer steps for the page to show several of them while the run trains
MODEL = "llama"  # the lab's default: its loss falls visibly within STEPS, as a live plot should show


def _missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements.txt)"
    for program in ("chromium", "chromedriver"):
        if not shutil.which(program):
            return f"no {program} on PATH (Debian: apt-get install chromium chromium-driver, as .ci/run does)"
    return None


@pytest.fixture(scope="module")
def browser_ready():
    reason = _missing()
    if reason and os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"COURSE_REQUIRE_BROWSER=1 but {reason}")
    if reason:
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server(browser_ready, tmp_path_factory):
    """JupyterLab by the README's command, on 127.0.0.1 only; yields its base URL with the token."""
    import secrets

    home = tmp_path_factory.mktemp("jupyter")
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # no news or update toasts over the page; no autosave (the committed notebook must stay as it is)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    docmanager = home / "settings" / "@jupyterlab" / "docmanager-extension"
    docmanager.mkdir(parents=True)
    (docmanager / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    # every cell in the page, not only those in view (JupyterLab 4 renders the visible ones by default)
    tracker = home / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    env.pop(environment.WORLD_SIZE_VARIABLE, None)
    log = open(home / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "helpers.course", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{(home / 'lab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer in 120 s:\n{(home / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token
    finally:
        try:  # shuts its kernels down too
            urllib.request.urlopen(urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST"),
                                   timeout=5)
            server.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(server.pid, signal.SIGKILL)  # the server we started, and anything left in its group
        except ProcessLookupError:
            pass
        server.wait()
        log.close()


@pytest.fixture(scope="module")
def driver(browser_ready):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2400",
                     "--force-device-scale-factor=1", "--disable-gpu"):
        options.add_argument(argument)
    chrome = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        yield chrome
    finally:
        chrome.quit()


def _text(driver, css: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", css)


def _wait(driver, what: str, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d))
    except Exception as error:  # TimeoutException: say what we waited for, and save the page
        IMAGES.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(IMAGES.parent / "browser-test-failure.png"))
        raise AssertionError(f"browser: no {what} within {timeout:.0f} s (see docs/browser-test-failure.png)") from error


def _click(driver, css: str) -> bool:
    """Click the first element matching ``css``; False (to try again) while it is missing or re-rendering."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    try:
        element = driver.find_element(By.CSS_SELECTOR, css)
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        element.click()
        return True
    except WebDriverException:
        return False


def _shot(driver, css: str, name: str) -> None:
    """Screenshot of one panel (scrolled to the top of the notebook's view first: parts outside it are clipped)."""
    from selenium.webdriver.common.by import By

    IMAGES.mkdir(parents=True, exist_ok=True)
    element = driver.find_element(By.CSS_SELECTOR, css)
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", element)
    time.sleep(0.3)  # let the notebook's lazy rendering catch up
    element.screenshot(str(IMAGES / name))


def test_config_lab_in_jupyterlab(lab_server, driver):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    base, token = lab_server
    started = time.monotonic()
    committed = (ROOT / "notebooks" / NOTEBOOK).read_bytes()
    driver.get(f"{base}/lab/tree/{NOTEBOOK}?token={token}&reset")
    _wait(driver, "notebook", lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell"), 90)
    _wait(driver, "idle kernel", lambda d: "Idle" in _text(d, ".jp-StatusBar-Widget, .jp-StatusBar") or
          d.find_elements(By.CSS_SELECTOR, ".jp-Toolbar-kernelStatus[title*='Idle'], [data-status='idle']"), 90)
    # run the lab cell as a learner does: click into it, Shift+Enter. On a loaded machine the kernel may
    # not take the first request (its prompt falls back to "[ ]"): then press again, as a learner would.
    deadline, pressed = time.monotonic() + 180, 0.0
    while not driver.find_elements(By.CSS_SELECTOR, ".course-builder"):
        prompt = _text(driver, ".jp-Notebook .jp-CodeCell .jp-InputPrompt").strip()
        if not pressed or (time.monotonic() - pressed > 20 and prompt in ("[ ]:", "")):
            _wait(driver, "the lab cell's editor to take a click", lambda d: _click(
                d, ".jp-Notebook .jp-CodeCell .jp-InputArea-editor .cm-content"))
            ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
            pressed = time.monotonic()
        if time.monotonic() > deadline:
            _wait(driver, "config builder", lambda d: False, 0)
        time.sleep(0.5)
    builder = driver.find_element(By.CSS_SELECTOR, ".course-builder")
    _wait(driver, "config view", lambda d: '"stage": 2' in _text(d, ".course-config"))
    _wait(driver, "calculator mark on stage 2", lambda d: any(
        line.split()[:2] == ["2", "none"] and "◀" in line for line in _text(d, ".course-calculator-table").splitlines()))

    # a builder control: the config and the calculator's marked row change
    stage3 = [b for b in builder.find_elements(By.CSS_SELECTOR, ".course-stage button") if b.text.strip() == "3"][0]
    stage3.click()
    _wait(driver, "stage 3 in the config", lambda d: '"stage": 3' in _text(d, ".course-config"))
    _wait(driver, "calculator mark on stage 3", lambda d: any(
        line.split()[:2] == ["3", "none"] and "◀" in line for line in _text(d, ".course-calculator-table").splitlines()))
    Select(driver.find_element(By.CSS_SELECTOR, ".course-precision select")).select_by_visible_text("bf16")
    _wait(driver, "bf16 in the config", lambda d: '"bf16"' in _text(d, ".course-config"))

    # break the batch arithmetic: the checker names the key and the fix, Launch turns off
    batch = driver.find_element(By.CSS_SELECTOR, ".course-train-batch input")
    batch.send_keys(Keys.CONTROL, "a")
    batch.send_keys("30", Keys.ENTER)
    _wait(driver, "batch finding", lambda d: "train_batch_size" in _text(d, ".course-findings")
          and "fix:" in _text(d, ".course-findings"))
    launch_button = driver.find_element(By.CSS_SELECTOR, "button.course-launch")
    assert not launch_button.is_enabled()
    _shot(driver, ".course-builder", "lab-builder-checker.png")
    batch.send_keys(Keys.CONTROL, "a")
    batch.send_keys("0", Keys.ENTER)
    _wait(driver, "a clean config", lambda d: "checker finds nothing" in _text(d, ".course-findings"))

    # a calculator control: its figures change
    before = _text(driver, ".course-calculator-table")
    assert "6,738,415,616" in before  # the 7B preset
    preset = Select(driver.find_element(By.CSS_SELECTOR, ".course-calc-preset select"))
    preset.select_by_visible_text(next(o.text for o in preset.options if o.text.startswith("70B ")))
    _wait(driver, "70B figures", lambda d: "68,976,648,192" in _text(d, ".course-calculator-table"))
    nodes = driver.find_element(By.CSS_SELECTOR, ".course-calc-nodes input")
    nodes.send_keys(Keys.CONTROL, "a")
    nodes.send_keys("4", Keys.ENTER)
    _wait(driver, "32 ranks", lambda d: "= 32 ranks" in _text(d, ".course-calculator-table"))
    assert _text(driver, ".course-calculator-table") != before
    _shot(driver, ".course-calculator", "lab-calculator.png")

    # launch a short run: progress, a growing loss plot, then the record
    Select(driver.find_element(By.CSS_SELECTOR, ".course-model select")).select_by_visible_text(MODEL)
    steps = driver.find_element(By.CSS_SELECTOR, ".course-steps input")
    steps.send_keys(Keys.CONTROL, "a")
    steps.send_keys(str(STEPS), Keys.ENTER)
    name = driver.find_element(By.CSS_SELECTOR, ".course-name input")
    name.send_keys(Keys.CONTROL, "a")
    name.send_keys(RUN_NAME, Keys.ENTER)
    _wait(driver, "the run's name and steps", lambda d: f"runs/{RUN_NAME}-{MODEL}-2r" in _text(d, ".course-prediction"))
    driver.execute_script("arguments[0].scrollIntoView()", launch_button)
    _wait(driver, "Launch enabled", lambda d: launch_button.is_enabled())
    # keep every state the page shows: the status line's texts and the loss plot's images
    driver.execute_script("""
        window.courseSeen = {status: [], plots: 0};
        const status = document.querySelector('.course-live-status'), plot = document.querySelector('.course-loss-plot');
        new MutationObserver(() => window.courseSeen.status.push(status.innerText))
            .observe(status, {subtree: true, childList: true, characterData: true});
        new MutationObserver(() => window.courseSeen.plots++).observe(plot, {attributes: true, attributeFilter: ['src']});
    """)
    launch_button.click()
    _wait(driver, "the record", lambda d: "states/rank" in _text(d, ".course-record"), 180)
    seen = driver.execute_script("return window.courseSeen")
    status = _text(driver, ".course-live-status")
    assert f"done, {STEPS} steps" in status, status
    # the page followed the run step by step: several steps before the last, each with its loss
    steps_seen = {int(t.split("step ")[1].split("/")[0]) for t in seen["status"] if f"/{STEPS}, loss" in t}
    assert len(steps_seen) >= 3 and min(steps_seen) < STEPS, seen["status"]
    assert seen["plots"] >= 2, seen
    record = _text(driver, ".course-record")
    assert f"{RUN_NAME}-{MODEL}-2r" in record and "summary.json" in record
    width = driver.execute_script("return document.querySelector('.course-progress .progress-bar').style.width")
    assert width == "100%", width
    assert driver.execute_script("return document.querySelector('.course-loss-plot').naturalWidth") > 100
    summary = json.loads((ROOT / "runs" / f"{RUN_NAME}-{MODEL}-2r" / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and summary["precision"] == "bf16" and summary["steps"] == STEPS
    assert summary["losses"][-1] < summary["losses"][0] - 1.0, summary["losses"]  # what the plot shows: learning
    assert json.loads((ROOT / "my_configs" / f"{RUN_NAME}.json").read_text())["zero_optimization"]["stage"] == 3
    _shot(driver, ".course-live", "lab-live-run.png")

    # my runs lists it at once
    _wait(driver, "my runs table", lambda d: f"{RUN_NAME}-{MODEL}-2r" in _text(d, ".course-my-runs-table"))
    _shot(driver, ".course-my-runs", "lab-my-runs.png")

    # an exercise, as a learner answers it: replace the ... of its cell, run it, read the verdict
    cell = driver.execute_script("""return [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].find(c =>
        (c.querySelector('.cm-content') || {}).innerText?.includes('exercise_smallest_stage(answer)'))""")
    assert cell is not None, "the lab's exercise cell is not in the page"
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].classList.add('course-exercise')", cell)
    _wait(driver, "the exercise's editor to take a click", lambda d: _click(d, ".course-exercise .cm-content"))
    ActionChains(driver).key_down(Keys.CONTROL).send_keys("a").key_up(Keys.CONTROL).perform()
    # a closing quote the editor added itself is typed over, as a closing bracket is
    ActionChains(driver).send_keys('answer = "none"').send_keys(Keys.ENTER).send_keys("widgets.exercise_smallest_stage(answer").perform()
    typed = _text(driver, ".course-exercise .cm-content")
    if not typed.rstrip().endswith(")"):  # the editor closes brackets by itself, or not
        ActionChains(driver).send_keys(")").perform()
    ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    _wait(driver, "the exercise's verdict", lambda d: "[smallest stage] right:" in _text(d, ".course-exercise .jp-OutputArea"), 60)
    _shot(driver, ".course-exercise", "lab-exercise.png")
    driver.set_window_size(1400, 1000)  # the whole JupyterLab window, as a learner sees it
    driver.execute_script("document.querySelector('.course-live').scrollIntoView({block: 'center'})")
    time.sleep(0.5)
    driver.save_screenshot(str(IMAGES / "lab-jupyterlab.png"))
    assert (ROOT / "notebooks" / NOTEBOOK).read_bytes() == committed, "JupyterLab changed the committed notebook"
    print(f"browser test: {time.monotonic() - started:.0f} s in the browser; saw steps {sorted(steps_seen)}")
