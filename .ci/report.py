"""What a CI run's test environments ran, read from their JUnit reports.

    python .ci/report.py JUNIT_DIR

Prints each environment's test count and summed test time, and the 25 slowest tests of the
run. Exits non-zero when a test module under ``tests/`` ran in no environment (each module
runs at least once per CI run: tests/tiers.py says where), or when a report is missing. Only
the standard library: it runs with the Python that runs CI.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOWEST = 25


def test_modules() -> set[str]:
    """Every test module of the project, as a path from the root."""
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")}


def module_of(classname: str) -> str:
    """The module path of a JUnit ``classname`` (``tests.unit.test_conf`` or
    ``tests.unit.test_conf.TestClass``)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (ROOT / candidate).is_file():
            return candidate
    return classname


def main(junit_dir: Path) -> int:
    reports = sorted(junit_dir.glob("*.xml"))
    if not reports:
        print(f"report: no JUnit reports in {junit_dir}")
        return 1
    ran: dict[str, set[str]] = defaultdict(set)
    timings: list[tuple[float, str, str]] = []
    for report in reports:
        env = report.stem
        count, seconds = 0, 0.0
        for case in ET.parse(report).getroot().iter("testcase"):
            module = module_of(case.get("classname", ""))
            took = float(case.get("time") or 0)
            count += 1
            seconds += took
            if case.find("skipped") is None:
                ran[module].add(env)
            timings.append((took, env, f"{module}::{case.get('name', '')}"))
        print(f"report: {env}: {count} tests, {seconds:.0f} s of test time")
    print(f"report: the {SLOWEST} slowest tests of the run")
    for took, env, test in sorted(timings, reverse=True)[:SLOWEST]:
        print(f"  {took:7.1f} s  {env}  {test}")
    missing = sorted(test_modules() - set(ran))
    if missing:
        print("report: these test modules ran in no environment (see tests/tiers.py):")
        print("\n".join(f"  {module}" for module in missing))
        return 1
    print(f"report: every one of the {len(test_modules())} test modules ran in at least one environment")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
