"""syscalls/rollbacks.py: which calls a client makes again after cancelling a gRPC pred."""

import errno
import types

from syscalls import convert, rollbacks
from syscalls import symphony_pb2 as pb


def busy() -> pb.Empty:
    return pb.Empty(error=pb.Error(errno=errno.EBUSY, message="busy"))


def test_only_a_busy_call_on_a_file_whose_pred_was_cancelled_is_made_again():
    r = rollbacks.Rollbacks()
    assert not r.again(convert.truncate(3, 0), busy()), "nothing cancelled: EBUSY stands"
    r.cancelled([3])
    assert r.again(convert.truncate(3, 0), busy())
    assert r.again(convert.splice(4, 0, 1, 3), busy()), "a splice into it"
    assert not r.again(convert.truncate(4, 0), busy()), "another file"
    assert not r.again(convert.truncate(3, 0), pb.Empty(
        error=pb.Error(errno=errno.EINVAL, message="bad"))), "only EBUSY"
    assert not r.again(convert.import_file(iter([])), busy()), "a streamed request"


def test_a_close_that_went_through_forgets_the_fd():
    r = rollbacks.Rollbacks()
    r.cancelled([3])
    assert not r.again(convert.truncate(3, 0), pb.Empty())
    assert r.again(convert.close(3), busy()), "a truncate that went through forgets nothing"
    assert not r.again(convert.close(3), pb.Empty())
    assert not r.again(convert.close(3), busy()), "fd 3 may be another file now"


def test_it_gives_up_after_cancel_wait(monkeypatch):
    r = rollbacks.Rollbacks()
    r.cancelled([3])
    later = rollbacks.time.monotonic() + rollbacks.CANCEL_WAIT + 1
    monkeypatch.setattr(rollbacks, "time", types.SimpleNamespace(monotonic=lambda: later))
    assert not r.again(convert.truncate(3, 0), busy())
    assert not r.until
