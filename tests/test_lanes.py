"""The lanes' rule (tests/conftest.py): what makes a test `real`, and the time limits."""

import helpers
import pytest


def test_require_real_fails_an_unmarked_test_and_lets_a_real_one_through(request):
    saved = helpers.CURRENT_TEST
    try:
        helpers.CURRENT_TEST = request.node  # this test, not marked `real`
        with pytest.raises(pytest.fail.Exception, match="mark it `real`"):
            helpers.require_real("runs `millstream run`")
        request.node.add_marker(pytest.mark.real)
        helpers.require_real("runs `millstream run`")  # marked: allowed
    finally:
        helpers.CURRENT_TEST = saved


def test_every_test_has_a_time_limit_and_real_ones_a_longer_one(request):
    from conftest import DEFAULT_TIMEOUT_S, REAL_TIMEOUT_S

    assert request.node.get_closest_marker("timeout").args == (DEFAULT_TIMEOUT_S,)
    assert REAL_TIMEOUT_S > DEFAULT_TIMEOUT_S


def test_the_helpers_that_start_the_real_stack_ask_for_the_mark():
    """Each helper that starts `millstream run` or a vLLM actor calls `require_real` first."""
    import inspect

    for helper in (helpers.start_run, helpers.millstream_run, helpers.start_actor):
        assert "require_real(" in inspect.getsource(helper), helper.__name__
