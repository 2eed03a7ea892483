"""The documentation site (docs/): it builds strictly, what it generates matches the code, and it
works in a real browser.

- The build is `make docs`' (sphinx-build -W -n): a broken link or reference, a page outside the
  table of contents, a docstring that does not render, or a public function or class without a
  docstring fails it.
- Headless Chromium (Debian's, driven by selenium) opens the home page and three guides (no
  console errors), searches for DistributedOptimizer and TorchEstimator, and keeps a screenshot of
  the home page in build/test-artifacts/docs/ (SPARK_HVD_TEST_ARTIFACTS elsewhere).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import PY, REPO

sys.path.insert(0, str(REPO / "docs" / "_ext"))
from spark_hvd_docs import api, generated  # noqa: E402

DOCS = REPO / "docs"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("SPARK_HVD_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as `make docs` builds it (strict), into a temporary folder."""
    out = tmp_path_factory.mktemp("docs") / "html"
    done = subprocess.run([PY, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-n", "-q",
                           str(DOCS), str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    warnings = [line for line in done.stderr.splitlines()
                if re.search(r"(WARNING|ERROR|CRITICAL):", line) and "absl::" not in line]
    assert done.returncode == 0 and not warnings, \
        f"the strict docs build failed ({done.returncode}):\n" + "\n".join(
            warnings or done.stderr.splitlines()[-40:])
    return out


def test_the_site_builds_strictly(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    for page in ("index.html", "getting-started.html", "migrating.html", "guides/pytorch.html",
                 "guides/tensorflow.html", "guides/numpy.html", "guides/spark.html",
                 "guides/estimators.html", "launching.html", "multi-host.html", "gpus.html",
                 "elastic.html", "configuration.html", "timeline.html", "autotuning.html",
                 "troubleshooting.html", "architecture.html", "benchmarks.html",
                 "reference/configuration.html", "reference/launcher.html", "api/torch.html",
                 "api/estimators.html", "search.html"):
        assert page in pages, page
    # The generated pages carry what the code says.
    configuration = (site / "reference" / "configuration.html").read_text()
    from spark_hvd.common import _config
    for name in _config.SETTINGS:
        assert f"SPARK_HVD_{name}" in configuration, name
    assert "DistributedOptimizer" in (site / "api" / "torch.html").read_text()


def test_every_public_function_and_class_has_a_docstring():
    assert api.undocumented() == []


def test_the_check_finds_a_missing_docstring():
    class Documented:
        """A class."""

        def method(self):
            pass

        @property
        def value(self):
            return 1

    assert api.undocumented_members(Documented) == ["method", "value"]


# -- the one table of settings ------------------------------------------------------------------

# Variables the code reads that are not user settings: the bootstrap contract's (a launcher sets
# them for each rank) and the handshakes between a Spark task or the launcher and its rank.
_NOT_SETTINGS = {"RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                 "RENDEZVOUS_ADDR", "SECRET", "JOB_ID", "HOSTNAME", "BIND_ADDR", "ELASTIC",
                 "ELASTIC_WORKER_ID", "SPARK_", "SPARK_DRIVER_ADDR", "SPARK_PAYLOAD", "SPARK_RESULT",
                 "SPARK_ERROR", "SPARK_GPUS", "VERBOSE", "NATIVE_DIR", "AUTOTUNE_"}


def _names_read_by_the_code(prefixes=("SPARK_HVD_",)) -> set[str]:
    sources = [p.read_text() for folder in ("spark_hvd", "native_build")
               for p in (REPO / folder).rglob("*.py")]
    sources += [(REPO / f).read_text() for f in ("build.py", "setup.py")]
    text = "\n".join(sources)
    names = {name for prefix in prefixes
             for name in re.findall(rf'"{prefix}([A-Z0-9_]+)"', text)}
    names |= set(re.findall(r'\b(?:env|env_int|env_float|env_flag|env_switch|setting)\('
                            r'\s*"([A-Z0-9_]+)"', text))
    return names


def test_every_variable_the_code_reads_is_in_the_settings_table():
    from spark_hvd.common import _config
    read = _names_read_by_the_code()
    missing = sorted(read - set(_config.SETTINGS) - _NOT_SETTINGS)
    assert not missing, f"read by the code but not in SETTINGS (common/_config.py): {missing}"
    # Read: its name, alone or with a prefix, is a string literal of the code (env("NAME"),
    # "SPARK_HVD_NAME", a tuple of names).
    sources = "\n".join(p.read_text() for folder in ("spark_hvd", "native_build")
                        for p in (REPO / folder).rglob("*.py") if p.name != "_config.py")
    sources += "\n".join((REPO / f).read_text() for f in ("build.py", "setup.py"))
    sources += (REPO / "spark_hvd" / "common" / "_config.py").read_text().split("SETTINGS = {")[0]
    sources += (REPO / "spark_hvd" / "common" / "_config.py").read_text().split("\ndef default(")[1]
    unread = sorted(name for name in _config.SETTINGS
                    if not re.search(rf'"(SPARK_HVD_|HOROVOD_)?{name}"', sources))
    assert not unread, f"in SETTINGS but read nowhere: {unread}"


def test_the_table_defaults_are_the_readers_defaults():
    from spark_hvd.common import _bootstrap_contract as contract, _config
    from spark_hvd.launch import supervise
    from spark_hvd.spark import _controller
    from spark_hvd.torch import optimizer
    table = _config.SETTINGS
    assert table["START_TIMEOUT"].default == contract.DEFAULT_START_TIMEOUT
    assert table["ELASTIC_TIMEOUT"].default == contract.DEFAULT_ELASTIC_TIMEOUT
    assert table["SPARK_START_TIMEOUT"].default == _controller.DEFAULT_START_TIMEOUT
    assert table["SPARK_HEARTBEAT_TIMEOUT"].default == _controller.DEFAULT_HEARTBEAT_TIMEOUT
    assert table["KILL_GRACE_SECONDS"].default == supervise.DEFAULT_GRACE_SECONDS
    assert table["GRADIENT_BUCKET_BYTES"].shown_default() == (
        f"{optimizer.DEFAULT_BUCKET_BYTES} (CUDA: {optimizer.DEFAULT_CUDA_BUCKET_BYTES})")
    config = _config.Config()
    assert config.fusion_threshold == table["FUSION_THRESHOLD"].default
    assert config.cycle_time_ms == table["CYCLE_TIME"].default
    assert config.peer_timeout == table["PEER_TIMEOUT_SECONDS"].default


def test_the_generated_tables():
    settings = generated.settings_tables()
    assert "| `SPARK_HVD_FUSION_THRESHOLD`<br>`HOROVOD_FUSION_THRESHOLD` | `134217728` |" \
        in settings
    variables = generated.horovod_variables_table()
    assert "| `HOROVOD_TORUS_ALLREDUCE` | warned |" in variables
    flags = generated.launcher_flags()
    for flag in ("`-np`", "`--min-np`", "`--autotune`", "`--network-interfaces`"):
        assert flag in flags, flag


# -- the browser ------------------------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if os.environ.get("SPARK_HVD_SKIP_BROWSER_TEST") == "1":
        pytest.skip("SPARK_HVD_SKIP_BROWSER_TEST=1")
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Chromium and its driver are missing: scripts/setup.sh installs them " \
        "(apt: chromium chromium-driver)"
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-extensions",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--window-size=1280,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _open(driver, url):
    driver.get(url)
    deadline = time.monotonic() + 30
    while driver.execute_script("return document.readyState") != "complete":
        assert time.monotonic() < deadline, f"{url} did not finish loading"
        time.sleep(0.1)
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, f"{url}: console errors {errors}"


@pytest.mark.parametrize("page", ["index.html", "guides/pytorch.html", "guides/estimators.html",
                                  "multi-host.html"])
def test_pages_render_without_console_errors(browser, served, page):
    from selenium.webdriver.common.by import By
    _open(browser, served + page)
    heading = browser.find_element(By.CSS_SELECTOR, "article h1")
    assert heading.text.strip()
    assert browser.find_element(By.CSS_SELECTOR, "article").size["height"] > 200
    # The navigation lists the guides.
    assert "PyTorch" in browser.find_element(By.CSS_SELECTOR, ".sidebar-tree").text


def test_home_page_screenshot(browser, served):
    _open(browser, served + "index.html")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / "docs-home.png"
    assert browser.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    print(f"screenshot: {path}")


@pytest.mark.parametrize("term, page", [("DistributedOptimizer", "api/torch.html"),
                                        ("TorchEstimator", "api/estimators.html")])
def test_search_finds(browser, served, term, page):
    from selenium.webdriver.common.by import By
    _open(browser, served + f"search.html?q={term}")
    deadline = time.monotonic() + 30
    links = []
    while time.monotonic() < deadline:
        links = [a.get_attribute("href") for a in
                 browser.find_elements(By.CSS_SELECTOR, "#search-results li a")]
        if links:
            break
        time.sleep(0.2)
    assert any(page in (link or "") for link in links), (term, links[:10])


# -- the troubleshooting page quotes the code -----------------------------------------------------

def test_every_troubleshooting_message_is_in_the_code():
    page = (DOCS / "troubleshooting.md").read_text()
    messages = re.findall(r"^### `(.+)`$", page, re.M)
    assert len(messages) >= 30, len(messages)
    sources = "\n".join(p.read_text(errors="replace") for folder in ("spark_hvd", "native")
                        for p in (REPO / folder).rglob("*")
                        if p.suffix in (".py", ".cc", ".h") and p.is_file())
    missing = [m for m in messages if m not in sources]
    assert not missing, f"docs/troubleshooting.md quotes messages the code no longer has: {missing}"


# -- the README is a landing page whose links resolve ------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor of a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_is_a_landing_page_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 220, "the README is the landing page: the manual is docs/"
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) >= 20, local
    broken = []
    for link in local:
        path, _, anchor = link.partition("#")
        target = REPO / path
        if not target.is_file():
            broken.append(link)
            continue
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(link)
    assert not broken, broken
    assert all(link.startswith("docs/") for link in local), \
        "the README links into the site (docs/), which is the manual"
