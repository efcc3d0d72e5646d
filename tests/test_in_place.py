"""The in-place recovery channel (`meshrun.in_place`): files in the rank's log directory."""

import os

import pytest

from meshrun import in_place

pytestmark = pytest.mark.timeout(10)


def test_the_worker_opts_in_is_offered_a_later_round_and_confirms(tmp_path, monkeypatch):
    monkeypatch.setenv(in_place.CHANNEL_ENV, str(tmp_path))
    pid = os.getpid()
    assert not in_place.opted_in(tmp_path, pid)
    assert in_place.opt_in()
    assert in_place.opted_in(tmp_path, pid)
    assert not in_place.opted_in(tmp_path, pid + 1)  # an earlier process's file is not this one's
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "1234", "MESHRUN_ROUND": "2",
           "PATH": "/bin", "MESHRUN_RDZV_SECRET": "x"}
    in_place.make_offer(tmp_path, 2, env, 5.0)
    assert in_place.offer_after(2) is None  # not later than the round it is in
    offer = in_place.offer_after(1)
    assert offer["round"] == 2 and offer["deadline_s"] == 5.0
    # only the round's variables travel: nothing else of the agent's environment
    assert offer["env"] == {"RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "1234",
                            "MESHRUN_ROUND": "2"}
    assert not in_place.confirmed(tmp_path, 2, pid)
    in_place.confirm(2)
    assert in_place.confirmed(tmp_path, 2, pid)
    assert not in_place.confirmed(tmp_path, 3, pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["confirmed", "offer", "ready"]


def test_without_a_channel_nothing_happens(monkeypatch):
    monkeypatch.delenv(in_place.CHANNEL_ENV, raising=False)
    assert not in_place.opt_in()
    assert in_place.offer_after(0) is None
    in_place.confirm(1)  # no-op


def test_a_bad_offer_is_no_offer(tmp_path, monkeypatch):
    monkeypatch.setenv(in_place.CHANNEL_ENV, str(tmp_path))
    for text in ("{", "[]", '{"round": "9", "env": {}}', '{"round": 9, "env": "x"}'):
        (tmp_path / in_place.OFFER).write_text(text)
        assert in_place.offer_after(0) is None, text


def test_nothing_the_other_side_writes_raises(tmp_path, monkeypatch):
    # the agent reads what a worker wrote and the worker what the agent wrote: JSON nested
    # too deep (RecursionError), a huge file, a directory or a FIFO in a file's place are no
    # file at all, and never raise or block
    monkeypatch.setenv(in_place.CHANNEL_ENV, str(tmp_path))
    pid = os.getpid()
    (tmp_path / in_place.READY).write_text("[" * 100_000)
    assert not in_place.opted_in(tmp_path, pid)
    (tmp_path / in_place.READY).write_text('{"pid": ' + str(pid) + ', "pad": "' + "x" * 10**6 + '"}')
    assert not in_place.opted_in(tmp_path, pid)
    (tmp_path / in_place.CONFIRMED).mkdir()
    assert not in_place.confirmed(tmp_path, 1, pid)
    os.mkfifo(tmp_path / in_place.OFFER)
    assert in_place.offer_after(0) is None


def test_a_channel_that_cannot_be_written(tmp_path, monkeypatch):
    # a full disk (here: a non-empty directory where the file goes): the worker's opt-in
    # fails quietly (it runs on as a worker that did not opt in), the agent's offer raises
    # OSError (it falls back to a restart), and no temporary file is left behind
    monkeypatch.setenv(in_place.CHANNEL_ENV, str(tmp_path))
    for name in (in_place.READY, in_place.OFFER):
        (tmp_path / name / "x").mkdir(parents=True)
    assert not in_place.opt_in()
    with pytest.raises(OSError):
        in_place.make_offer(tmp_path, 1, {"RANK": "0"}, 5.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [in_place.OFFER, in_place.READY]
