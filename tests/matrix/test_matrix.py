"""Every Celery result path × pool × fault, on real workers, judged by one checker.

For each (pool, fault) the worker pair is started once and every path's task is sent in one
go (:mod:`tests.matrix.scenario`); each cell (pool, fault, path) is then judged by
:mod:`tests.matrix.checker` on what was stored. A cell that differs is listed, with its
reason, in one of the two tables below and runs as ``xfail(strict=True)``: a cell that starts
to hold is noticed. ``docs/guarantees.rst`` ("The result paths × pools × faults") has the same
tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import Cluster
from tests.matrix.app import MATRIX_SETTINGS
from tests.matrix.checker import accepted, describe, expected, problems, verdict
from tests.matrix.scenario import FAULTS, PATHS, PLAIN_TWINS, POOLS, Observed, run_scenario
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

Cell = tuple[str, str, str]  # (pool, fault, path); "*" matches any

#: Cells that cannot hold, whatever the code: the pool or Celery itself does not allow it.
CANNOT_HOLD: dict[Cell, str] = {}

#: Cells that fail today for holes being fixed: flip each one when its fix lands.
KNOWN_HOLES: dict[Cell, str] = {}


def listed(table: dict[Cell, str], pool: str, fault: str, path: str) -> str | None:
    for (p, f, a), reason in table.items():
        if p in ("*", pool) and f in ("*", fault) and a in ("*", path):
            return reason
    return None


def cells() -> Iterator[Any]:
    for pool in POOLS:
        for fault in FAULTS:
            for path in PATHS:
                # Each (pool, fault) scenario runs once per process: its cells stay together
                # under pytest-xdist's --dist loadgroup.
                marks: list[Any] = [pytest.mark.xdist_group(f"{pool}-{fault}")]
                reason = listed(CANNOT_HOLD, pool, fault, path)
                if reason is None:
                    hole = listed(KNOWN_HOLES, pool, fault, path)
                    reason = f"known: {hole}" if hole else None
                if reason is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                yield pytest.param((pool, fault), path, marks=marks, id=f"{pool}-{fault}-{path}")


#: Each scenario's observations: run once, for all the cells of its (pool, fault).
_OBSERVED: dict[tuple[str, str], Observed] = {}


@pytest.fixture
def scenario(
    request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Observed:
    """One (pool, fault) scenario, run at its first cell; its workers stop once it is collected."""
    pool, fault = request.param
    if (pool, fault) in _OBSERVED:
        return _OBSERVED[pool, fault]
    with redis_server.client() as client:
        client.flushall()
    cluster = Cluster(redis_server, tmp_path_factory.mktemp(f"matrix-{pool}-{fault}"))
    cluster.settings = dict(MATRIX_SETTINGS)
    try:
        observed = run_scenario(cluster, pool, fault)
    finally:
        cluster.stop()
        if redis_server.running():
            with redis_server.client() as client:
                client.flushall()
    print(f"\n{pool} × {fault}: " + "; ".join(observed.notes))
    _OBSERVED[pool, fault] = observed
    return observed


@pytest.mark.parametrize(("scenario", "path"), list(cells()), indirect=["scenario"])
def test_cell(scenario: Observed, path: str) -> None:
    found = []
    for seen in scenario.paths[path]:
        for problem in verdict(accepted(scenario.pool, path, seen.role, seen), seen, path):
            found.append(f"{seen.role} {seen.task_id}: {problem}")
    if found:
        details = "\n".join(describe(seen) for seen in scenario.paths[path])
        logs = "\n".join(scenario.log_lines(seen.task_id) for seen in scenario.paths[path])
        notes = "\n".join(scenario.notes)
        pytest.fail(
            f"{scenario.pool} × {scenario.fault} × {path}:\n  "
            + "\n  ".join(found)
            + f"\n{details}\nscenario notes:\n{notes}\nlog lines:\n{logs[-8000:]}",
            pytrace=False,
        )


@pytest.mark.parametrize(
    ("scenario", "path"),
    [
        pytest.param((pool, "none"), path, id=f"{pool}-{path}", marks=pytest.mark.xdist_group(f"{pool}-none"))
        for pool in POOLS
        for path in PLAIN_TWINS
    ],
    indirect=["scenario"],
)
def test_plain_celery_stores_what_the_checker_expects(scenario: Observed, path: str) -> None:
    """The checker's expectation, held against a plain task of the same path on the same pool."""
    seen = scenario.plain[path]
    outcome = expected(scenario.pool, path, "task")
    found = [p for p in problems(outcome, seen, path) if "lease" not in p]
    assert not found, f"{describe(seen)}\n{found}\n{scenario.log_lines(seen.task_id)[-4000:]}"
