"""Celery's own integration suite, run against celery-fenced.

    python tests/celery_suite/run.py --mode fenced [--pool gevent] [--tests test_canvas.py ...] [--timeout 30]

The suite comes from the sdist of the installed Celery (``pip download``, cached). The runner
puts ``overlay_conftest.py`` at the sdist's root as ``conftest.py``, starts a private
``redis-server`` for broker and backend, and runs the suite with a short per-test timeout
(a test that hangs costs one timeout: no reruns). ``--shards N`` deals the tests round into N
runs side by side, each with its own ``redis-server`` and worker (the suite waits on its
worker far more than it computes). ``--mode`` is ``plain`` (Celery as it is,
the baseline), ``backend`` (``FencedRedisBackend`` under the ``redis://`` URL) or ``fenced``
(that backend, and every task a ``ProgressLeasedTask``). ``--pool`` is the suite worker's pool:
``prefork`` as Celery's suite has it, or ``gevent``: the runner then makes the suite's
``celery_worker_pool`` fixture return it, and runs pytest under ``python -m gevent.monkey`` so
that everything is patched before the suite imports Celery, as ``celery worker -P gevent`` does.

It passes when every test that failed is listed in ``baseline-failures-celery-X.Y.txt`` for the
installed Celery (``…-X.Y-gevent.txt`` on gevent: tests that fail with plain ``redis://`` on
this machine too) or, for the
fenced modes, in
``known-fenced-failures.txt`` (defects not yet fixed; the list only shrinks). An unlisted
failure is run once more, alone: it fails the run only if it fails again, and is shown either
way. It prints the listed tests that passed, so a list can be trimmed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

from celery_fenced.testing import RedisServer, default_binary

HERE = Path(__file__).resolve().parent
DEFAULT_TESTS = ("test_tasks.py", "test_canvas.py")
#: Unlisted failures run once more, alone, when there are at most this many.
RUN_AGAIN_AT_MOST = 10
CACHE = Path(os.environ.get("FENCED_CELERY_SDIST_CACHE", Path.home() / ".cache" / "celery-fenced" / "celery-sdist"))


def celery_sdist() -> Path:
    """The sdist of the installed Celery, downloaded once into the cache."""
    wanted = version("celery")
    found = sorted(CACHE.glob(f"celery-{wanted}.tar.gz"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        download = ["download", "-q", "--no-deps", "--no-binary", ":all:", f"celery=={wanted}", "-d", str(CACHE)]
        subprocess.run([sys.executable, "-m", "pip", *download], check=True)
        found = sorted(CACHE.glob(f"celery-{wanted}.tar.gz"))
    return found[0]


#: The suite's own pool fixture (t/integration/conftest.py, Celery 5.5 to 5.7).
SUITE_POOL_FIXTURE = "def celery_worker_pool():\n    return 'prefork'\n"


def unpack(sdist: Path, into: Path, pool: str) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    (root,) = into.iterdir()
    shutil.copy(HERE / "overlay_conftest.py", root / "conftest.py")
    if pool != "prefork":
        suite_conftest = root / "t" / "integration" / "conftest.py"
        text = suite_conftest.read_text()
        if SUITE_POOL_FIXTURE not in text:
            raise SystemExit(f"{suite_conftest} has no `celery_worker_pool` returning 'prefork' to change")
        suite_conftest.write_text(text.replace(SUITE_POOL_FIXTURE, SUITE_POOL_FIXTURE.replace("prefork", pool)))
    return root


def listed(name: str) -> set[str]:
    path = HERE / name
    lines = path.read_text().splitlines() if path.exists() else []
    return {line.split("#", 1)[0].strip() for line in lines} - {""}


def baseline_of_installed_celery(mode: str, pool: str) -> str:
    """The name of the baseline file of the installed Celery's minor version, on ``pool``.

    The plain mode, which makes a baseline, runs without one; the fenced modes need it.
    """
    minor = ".".join(version("celery").split(".")[:2])
    name = f"baseline-failures-celery-{minor}{'' if pool == 'prefork' else '-' + pool}.txt"
    if not (HERE / name).exists() and mode != "plain":
        raise SystemExit(
            f"no baseline for Celery {minor} on {pool}: run `python {Path(__file__).name} --mode plain --pool {pool}` "
            f"on it and list the tests that fail in {HERE / name}"
        )
    return name


def outcomes(junit: Path) -> tuple[set[str], set[str], int]:
    """(failed ids, passed ids, skipped count) from a JUnit report; ids are ``file::Class::test``."""
    failed: set[str] = set()
    passed: set[str] = set()
    skipped = 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").removeprefix("t.integration.").partition(".")
        test_id = "::".join(filter(None, (f"{module}.py", cls, case.get("name", ""))))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(test_id)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed.add(test_id)
    return failed, passed - failed, skipped


def env_of(args: argparse.Namespace, redis: RedisServer | None) -> dict[str, str]:
    """The environment of a run of the suite on ``redis`` (none: for collecting only)."""
    env = dict(
        os.environ,
        FENCED_CELERY_SUITE=args.mode,
        FENCED_CELERY_SUITE_POOL=args.pool,
        FENCED_CELERY_SUITE_TIMEOUT=str(args.timeout),
    )
    if redis is not None:
        env.update(
            TEST_BROKER=redis.url(0),
            TEST_BACKEND=redis.url(1),
            REDIS_HOST="127.0.0.1",
            REDIS_PORT=str(redis.port),
        )
    return env


def pytest_argv(args: argparse.Namespace) -> list[str]:
    pytest = ["-m", "gevent.monkey", "--module", "pytest"] if args.pool == "gevent" else ["-m", "pytest"]
    argv = [sys.executable, *pytest, "-p", "celery.contrib.pytest", "-p", "no:cacheprovider"]
    if find_spec("pytest_rerunfailures") is not None:
        argv += ["-p", "no:rerunfailures"]
    return argv


def collect(root: Path, env: dict[str, str], tests: list[str]) -> list[str]:
    """The node ids of ``tests``, as the suite collects them."""
    argv = [sys.executable, "-m", "pytest", "-p", "celery.contrib.pytest", "-p", "no:cacheprovider", "--co", "-q"]
    done = subprocess.run([*argv, *tests], cwd=root, env=env, capture_output=True, text=True, check=False)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        raise SystemExit(f"collecting {' '.join(tests)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


def split(ids: list[str], shards: int) -> list[list[str]]:
    """``ids`` dealt round in ``shards`` groups: the slow tests of a class (the large chords)
    are spread over the groups instead of all landing in one. Celery's suite keeps no state
    between the tests of a class (each takes the session's app and worker as it finds them)."""
    return [group for group in (ids[start::shards] for start in range(shards)) if group]


def start_pytest(
    root: Path, env: dict[str, str], args: argparse.Namespace, tests: list[str], report: Path
) -> subprocess.Popen[bytes]:
    """Start one run of ``tests``, its JUnit report written to ``report``."""
    argv = [*pytest_argv(args), f"--timeout={args.timeout}", "-q", "-rfE", f"--junitxml={report}"]
    print(f"celery suite ({args.mode}, {args.pool}): {report.stem}: {len(tests)} tests", flush=True)
    return subprocess.Popen([*argv, *tests, *args.pytest_args], cwd=root, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("plain", "backend", "fenced"), required=True)
    parser.add_argument("--pool", choices=("prefork", "gevent"), default="prefork", help="the suite worker's pool")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="files of t/integration")
    parser.add_argument("--timeout", type=int, default=30, help="per-test timeout, seconds")
    parser.add_argument("--shards", type=int, default=1, help="runs side by side, each on its own Redis")
    parser.add_argument("--keep", type=Path, help="keep the work folder here (for a look afterwards)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix=f"celery-suite-{args.mode}-{args.pool}-"))
    root = unpack(celery_sdist(), work / "src", args.pool)
    allowed = listed(baseline_of_installed_celery(args.mode, args.pool))
    if args.mode != "plain":
        allowed |= listed("known-fenced-failures.txt")
    servers: list[RedisServer] = []
    failed: set[str] = set()
    passed: set[str] = set()
    skipped = 0
    flaky: list[str] = []
    new: list[str] = []
    try:
        tests = [f"t/integration/{name}" for name in args.tests]
        shards = split(collect(root, env_of(args, None), tests), args.shards) if args.shards > 1 else [tests]
        runs = []
        for number, shard in enumerate(shards):
            servers.append(RedisServer(default_binary(), work / f"redis-{number}").start())
            report = work / f"junit-{number}.xml"
            runs.append((start_pytest(root, env_of(args, servers[-1]), args, shard, report), report))
        for process, report in runs:
            process.wait()
            if not report.exists():
                raise RuntimeError(f"pytest wrote no report {report.name}")
            shard_failed, shard_passed, shard_skipped = outcomes(report)
            failed |= shard_failed
            passed |= shard_passed
            skipped += shard_skipped
        passed -= failed
        print(
            f"\ncelery suite ({args.mode}, {args.pool}): {len(passed)} passed, {len(failed)} failed, {skipped} skipped"
        )
        new = sorted(failed - allowed)
        if new and len(new) <= RUN_AGAIN_AT_MOST:
            # One more run of the unlisted failures alone (not a blanket rerun of every test):
            # a test that fails twice is a failure; one that passes the second time is shown.
            # Only a test that passed the second time is flaky: one that failed again, or did not
            # run at all (a module that cannot be collected), is a failure.
            again = work / "again.xml"
            start_pytest(root, env_of(args, servers[0]), args, [f"t/integration/{t}" for t in new], again).wait()
            _, again_passed, _ = outcomes(again) if again.exists() else (set(), set(), 0)
            flaky = sorted(set(new) & again_passed)
            new = sorted(set(new) - again_passed)
    finally:
        for server in servers:
            server.stop()
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)

    trimmed = sorted(allowed & passed)
    if trimmed:
        print("listed as failing, passed this time:\n  " + "\n  ".join(trimmed))
    if flaky:
        print("FAILED once, passed when run again alone (timing; look at these):\n  " + "\n  ".join(flaky))
    if new:
        print("FAILED, and not listed as a known failure:\n  " + "\n  ".join(new))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
