"""A subscriber hammering the replay socket (a hostile local user, or a
buggy indexer in a reconnect loop) cannot make the store walk its keys more
than once per SNAPSHOT_INTERVAL_S; every replay is still answered."""
from __future__ import annotations

import time

import zmq

from kvstore.events.format import AllBlocksCleared, decode
from kvstore.events.publisher import END_SEQ, SNAPSHOT_INTERVAL_S
from tests.events.test_events import IDENT, held, local_store, on_loop, publishing, put


def test_a_replay_flood_makes_at_most_one_snapshot_per_interval(tmp_path):
    kv = local_store(tmp_path)
    pub = publishing(kv, tmp_path, buffer_steps=2)     # the start is gone: every replay from 0 needs a snapshot
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/replay")
    answered = with_snapshot = empty = 0
    try:
        started = time.monotonic()
        for i in range(60):
            put(kv, IDENT, 16 * 4 * i, 4)              # a batch sealed between requests: no snapshot is reused
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            first = True
            while True:
                assert dealer.poll(20_000), "a replay went unanswered"
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    empty += first         # nothing but the end marker: asked again later
                    break
                # a snapshot: a batch that starts over, not the stream's own first (a start snapshot)
                if first and isinstance(decode(payload).events[0], AllBlocksCleared) \
                        and int.from_bytes(seq, "big") != pub.log.first_seq:
                    with_snapshot += 1
                first = False
            answered += 1
        elapsed = time.monotonic() - started
        made = pub.counters()["snapshots"]
        assert answered == 60
        assert made == with_snapshot >= 1
        assert made <= elapsed / SNAPSHOT_INTERVAL_S + 1      # the walk of every key is rate-bound
        assert pub.snapshots_deferred == empty >= 60 - made - 1 - elapsed / SNAPSHOT_INTERVAL_S
        # once the interval has passed a replay gets a snapshot again: the exact picture
        time.sleep(SNAPSHOT_INTERVAL_S)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        media: dict[str, set[str]] = {}
        while True:
            assert dealer.poll(20_000)
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            for event in decode(payload).events:
                if isinstance(event, AllBlocksCleared):
                    media.clear()
                elif hasattr(event, "token_ids"):
                    media.setdefault(event.medium, set()).update(h.hex() for h in event.block_hashes)
                else:
                    media.setdefault(event.medium, set()).difference_update(h.hex() for h in event.block_hashes)
        truth = held(lambda: kv.store, on_loop(kv))
        assert {m: hs for m, hs in media.items() if hs} == {m: hs for m, hs in truth.items() if hs} != {}
    finally:
        dealer.close(linger=0)
        ctx.term()
        kv.close()
        pub.close()
