"""symphony/owed.py as plain data: what a user's lifelines owe, and which it holds."""

from __future__ import annotations

from symphony.owed import BACKED_UP_MAX, OWED_LOW, OWED_MAX, Owed


def test_a_debtor_past_owed_max_is_over_until_it_owes_owed_low():
    owed, resumed = Owed(), []
    owed.add("u", OWED_MAX - 1)
    assert "u" not in owed.over
    owed.add("u", 1)
    assert owed.over == {"u"}  # another debtor is not
    owed.hold("u", lambda: resumed.append(1))
    owed.hold("u", lambda: resumed.append(2))
    owed.pay("u", OWED_MAX - OWED_LOW - 1)
    assert resumed == [] and "u" in owed.over  # under the mark, not yet back to the low one
    owed.pay("u", 1)
    assert sorted(resumed) == [1, 2] and not owed.over
    owed.pay("u", OWED_LOW)
    assert not owed.owed and not owed._held  # nothing kept for a debtor that owes nothing


def test_a_debtor_with_backed_up_max_lifelines_is_over_until_one_reads_or_ends():
    owed, resumed = Owed(), []
    for _ in range(BACKED_UP_MAX - 1):
        owed.backs_up("u", True)
    assert "u" not in owed.over
    owed.backs_up("u", True)
    assert "u" in owed.over
    owed.hold("u", lambda: resumed.append(1))
    owed.add("u", OWED_MAX)  # and past OWED_MAX: both must be back under to go on
    owed.backs_up("u", False)
    assert resumed == [] and "u" in owed.over
    owed.pay("u", OWED_MAX)
    assert resumed == [1] and not owed.over


def test_a_lifeline_that_is_gone_is_not_resumed():
    owed, resumed = Owed(), []
    owed.add("u", OWED_MAX)

    def resume() -> None:
        resumed.append(1)

    owed.hold("u", resume)
    owed.forget("u", resume)
    owed.pay("u", OWED_MAX)
    assert resumed == [] and not owed._held and not owed.over
