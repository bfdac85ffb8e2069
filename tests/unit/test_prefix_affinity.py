"""Prefix-aware dp routing (router.dp_prefix_affinity, runtime/http/prefix_affinity.py): a
conversation's next turn goes to the replica that got its history, unless that replica is more than
the slack busier than the least loaded one; without affinity the least loaded replica gets it."""
import asyncio

from llaunch.runtime.http.engine_client import EngineClient
from llaunch.runtime.http.prefix_affinity import PrefixAffinity
from llaunch.runtime.ipc.messages import SamplingParams


def submit_all(client, prompts):
    async def go():
        return [(await client.submit([(p, SamplingParams(max_new_tokens=8))])).replica for p in prompts]
    return asyncio.run(go())


async def _post(replica, msg):
    pass


def test_longest_known_prefix_wins_by_whole_blocks():
    a = PrefixAffinity(block=4)
    a.record(list(range(10)), 1)  # blocks [0..4) and [4..8)
    a.record(list(range(5)) + [99, 98, 97], 0)  # shares one block with the first
    assert a.holder(list(range(12))) == (1, 8)
    assert a.holder(list(range(4)) + [7, 7, 7, 7]) == (0, 4)  # the shared block's latest owner
    assert a.holder([5, 5, 5, 5, 5]) is None and a.holder([0, 1, 2]) is None


def test_a_conversation_stays_on_its_replica_within_the_slack():
    history = list(range(100, 300))
    turns = [history, history + [7] * 70, history + [7] * 70 + [8] * 70]
    plain = EngineClient(0, 2, _post)
    assert submit_all(plain, turns) == [0, 1, 0]  # least loaded: the turns scatter
    sticky = EngineClient(0, 2, _post, affinity_slack=10_000)
    assert submit_all(sticky, turns) == [0, 0, 0]
    other = list(range(5000, 5200))
    assert submit_all(sticky, [other]) == [1]  # unknown prefix: least loaded
    tight = EngineClient(0, 2, _post, affinity_slack=300)
    assert submit_all(tight, turns) == [0, 0, 1]  # by the third turn replica 0 is 486 tokens busier
