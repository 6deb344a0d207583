from bridge.producer.source.sequencer import SeqTracker, Verdict


def test_in_order_then_gap_then_catch_up_duplicates() -> None:
    t = SeqTracker()
    assert t.classify_live(0) is Verdict.ACCEPT
    t.emitted(0)
    assert t.classify_live(1) is Verdict.ACCEPT
    t.emitted(1)
    assert t.classify_live(4) is Verdict.GAP
    assert t.next_wanted() == 2
    # replay delivered 2..6 while the live stream was still at 4
    for seq in (2, 3, 4, 5, 6):
        assert t.wants(seq)
        t.emitted(seq)
    assert t.classify_live(5) is Verdict.DUPLICATE
    assert t.classify_live(6) is Verdict.DUPLICATE
    assert t.classify_live(7) is Verdict.ACCEPT


def test_live_seq_going_back_is_a_restart() -> None:
    t = SeqTracker()
    for seq in range(5):
        assert t.classify_live(seq) is Verdict.ACCEPT
        t.emitted(seq)
    assert t.classify_live(0) is Verdict.RESTART
    t.restart()
    assert t.next_wanted() == 0


def test_a_fresh_tracker_wants_history_from_zero() -> None:
    t = SeqTracker()
    assert t.classify_live(3) is Verdict.GAP
    assert t.next_wanted() == 0
