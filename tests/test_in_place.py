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
