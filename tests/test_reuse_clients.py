"""The three cache clients prefix reuse may hold (this worker's, a distributed group's rank 0 and
its followers) answer ReuseClient's calls with its signatures: a call changed in one and not the
others failed every lookup of a group (served without reuse, the exception caught by design)."""

import inspect

from worker.cache_client import CacheClient, ReuseClient
from worker.distributed.reuse import FollowerClient, LeaderClient

CALLS = [name for name, f in vars(ReuseClient).items() if inspect.isfunction(f) and not name.startswith("_")]


def test_every_client_answers_each_call_with_the_protocol_s_signature():
    assert set(CALLS) == {"lookup", "store", "drop", "heartbeat", "close"}
    for cls in (CacheClient, LeaderClient, FollowerClient):
        for name in CALLS:
            own = vars(cls).get(name)
            if own is None:  # LeaderClient passes the rest to rank 0's CacheClient
                assert cls is LeaderClient and "__getattr__" in vars(cls), (cls, name)
                own = vars(CacheClient)[name]
            assert inspect.signature(own) == inspect.signature(getattr(ReuseClient, name)), (cls.__name__, name)
