"""Status page logins: the admin token buys a random, expiring page session; guessing is bounded."""

from __future__ import annotations

import pytest

from agentic_lora.errors import AccessDeniedError
from agentic_lora.gateway.ui.auth import MAX_TOKEN_LENGTH
from agentic_lora.gateway.ui.auth import UILogins

TOKEN = "the-admin-token"


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def refused(logins: UILogins, given: str) -> str:
    with pytest.raises(AccessDeniedError) as err:
        logins.login(given)
    return str(err.value.details["reason"])


def test_the_right_token_buys_a_random_page_session_that_is_never_the_token() -> None:
    logins = UILogins(TOKEN, ttl=60)
    first, second = logins.login(TOKEN), logins.login(f"  {TOKEN}\n")
    assert first.value != second.value
    assert TOKEN not in first.value
    assert len(first.value) >= 43  # 32 random bytes, URL-safe
    assert first.max_age == 60
    assert logins.valid(first.value)
    assert logins.valid(second.value)
    # The server keeps digests only: no live value is held to be read back.
    assert first.value not in repr(vars(logins))
    assert len(logins) == 2


def test_a_wrong_token_or_a_made_up_session_is_refused() -> None:
    logins = UILogins(TOKEN)
    assert refused(logins, "wrong") == "bad_admin_token"
    assert refused(logins, TOKEN + "x") == "bad_admin_token"
    assert refused(logins, "x" * (MAX_TOKEN_LENGTH + 1)) == "bad_admin_token"
    for value in (None, "", "made-up", TOKEN, "x" * 10_000):
        assert not logins.valid(value)
    assert len(logins) == 0


def test_a_page_session_ends_at_its_deadline_or_its_logout() -> None:
    clock = Clock()
    logins = UILogins(TOKEN, ttl=100, clock=clock)
    grant = logins.login(TOKEN)
    other = logins.login(TOKEN)
    clock.now += 99.9
    assert logins.valid(grant.value)
    assert logins.logout(other.value) is True
    assert logins.logout(other.value) is False
    assert logins.logout(None) is False
    assert not logins.valid(other.value)
    clock.now += 0.1
    assert not logins.valid(grant.value)
    assert len(logins) == 0


def test_failed_logins_are_bounded_for_everyone_until_the_window_passes() -> None:
    clock = Clock()
    logins = UILogins(TOKEN, max_failures=3, failure_window=60, clock=clock)
    for _ in range(3):
        assert refused(logins, "guess") == "bad_admin_token"
        clock.now += 1
    # Past the bound even the right token waits: a guesser learns nothing by timing answers.
    with pytest.raises(AccessDeniedError) as err:
        logins.login(TOKEN)
    assert err.value.details == {"reason": "too_many_attempts", "retry_after": 57.0}
    assert logins.retry_after() == pytest.approx(57.0)
    clock.now += 57.0  # the first failure leaves the window
    assert logins.retry_after() == 0.0
    assert logins.valid(logins.login(TOKEN).value)
    assert refused(logins, "guess") == "bad_admin_token"
    assert refused(logins, TOKEN) == "too_many_attempts"


def test_the_oldest_page_session_ends_when_too_many_are_live() -> None:
    logins = UILogins(TOKEN, max_sessions=2)
    grants = [logins.login(TOKEN) for _ in range(3)]
    assert [logins.valid(g.value) for g in grants] == [False, True, True]


def test_without_an_admin_token_nobody_logs_in() -> None:
    logins = UILogins(None)
    assert not logins.enabled
    assert refused(logins, "") == "admin_disabled"
    assert refused(logins, "anything") == "admin_disabled"


@pytest.mark.parametrize(
    "bad", [{"ttl": 0}, {"max_sessions": 0}, {"max_failures": 0}, {"failure_window": -1}]
)
def test_bounds_must_be_positive(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        UILogins(TOKEN, **bad)  # type: ignore[arg-type]
