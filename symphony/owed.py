"""What the replies of a debtor's lifeline and ring preds can make the kernel keep: a
debtor is a user's processes together, or one of root's (reply_budget.debtor).

A process that does not read its replies stops being taken from once they pass
server.REPLIES_HIGH, but the preds it had in flight then are still answered into its
write buffer. Counted per process, each of a user's 256 processes could have had 64 MiB
in flight, and kept it all unread: 16 GiB. So the bounds are the user's:

- the bytes the replies of its preds in flight could take (syscall_table.reply_bound):
  past OWED_MAX its lifelines take no more preds until it owes OWED_LOW or less; the pred
  that crosses the mark is taken: one alone, of up to 64 MiB, always is;
- its lifelines whose replies back up: while BACKED_UP_MAX of them are past REPLIES_HIGH,
  none of its lifelines takes more (each new one would keep what it had in flight too).

A user's unread replies are then at most BACKED_UP_MAX times (REPLIES_HIGH + OWED_MAX),
OWED_MAX more in flight, and under REPLIES_HIGH on each other lifeline.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

OWED_MAX = 64 << 20
OWED_LOW = 48 << 20
BACKED_UP_MAX = 4


class Owed:
    def __init__(self) -> None:
        # debtor -> bytes its preds in flight owe: a dict, as it changes twice a pred
        # (a Counter's missing key and its del run Python)
        self.owed: dict[object, int] = {}
        self.backed_up: Counter[object] = Counter()  # debtor -> its lifelines backed up
        # Debtors that passed a bound and are not yet back under OWED_LOW and BACKED_UP_MAX:
        # a set, since every lifeline asks before it takes each pred.
        self.over: set[object] = set()
        # debtor -> how to take again from each lifeline that found it over
        self._held: dict[object, set[Callable[[], None]]] = {}

    def hold(self, debtor: object, resume: Callable[[], None]) -> None:
        """A lifeline of the debtor takes no more until resume() is called."""
        self._held.setdefault(debtor, set()).add(resume)

    def forget(self, debtor: object, resume: Callable[[], None]) -> None:
        """The lifeline is gone: nothing to resume."""
        held = self._held.get(debtor)
        if held is not None:
            held.discard(resume)
            if not held:
                del self._held[debtor]

    def add(self, debtor: object, size: int) -> None:
        owed = self.owed[debtor] = self.owed.get(debtor, 0) + size
        if owed >= OWED_MAX:
            self.over.add(debtor)

    def pay(self, debtor: object, size: int) -> None:
        """Preds of the debtor's owing `size` in all were answered or are gone."""
        owed = self.owed.get(debtor, 0) - size
        if owed:
            self.owed[debtor] = owed
        else:
            self.owed.pop(debtor, None)
        if debtor in self.over:
            self._go_on(debtor)

    def backs_up(self, debtor: object, up: bool) -> None:
        """A lifeline of the debtor passed REPLIES_HIGH (up), or read its replies down to
        REPLIES_LOW or is gone (not up)."""
        self.backed_up[debtor] += 1 if up else -1
        if self.backed_up[debtor] >= BACKED_UP_MAX:
            self.over.add(debtor)
        if not self.backed_up[debtor]:
            del self.backed_up[debtor]
        if not up and debtor in self.over:
            self._go_on(debtor)

    def _go_on(self, debtor: object) -> None:
        """Back under OWED_LOW and BACKED_UP_MAX: the debtor's held lifelines take again."""
        if self.owed.get(debtor, 0) <= OWED_LOW and self.backed_up[debtor] < BACKED_UP_MAX:
            self.over.discard(debtor)
            for resume in self._held.pop(debtor, ()):
                resume()
