"""Fixtures of the served tests: `held` (the shared server's tick budget) and `secured` (the session's launcher
with every key set). The session's `server` is in tests/conftest.py, so that tests/client shares it too; modules that
need other parameters start their own with tests/helpers/servers.py's `module_server`.
"""

from __future__ import annotations

import pytest

from tests.helpers.early_servers import starts_early, take_early
from tests.helpers.launched import SECURED_ENV, Launcher, served
from tests.helpers.servers import default_model_path


@pytest.fixture
def held(server):
    """The shared server's tick budget, released (and the engine running freely) after the test."""
    yield server.budget
    server.budget.release()


def _start_secured(tmp_path_factory):
    """The session's `secured` launcher, not waiting until it serves."""
    return Launcher(tmp_path_factory.mktemp("secured"), default_model_path(), env=SECURED_ENV)


@pytest.fixture(scope="session")
@starts_early(_start_secured)
def secured(tmp_path_factory):
    """`make serve`'s launcher with every key it takes set (tests/helpers/launched.py, SECURED_ENV),
    shared by the session's security tests, started early (tests/helpers/early_servers.py). Tests must leave it serving."""
    with served(take_early(_start_secured, tmp_path_factory)) as launched:
        yield launched
