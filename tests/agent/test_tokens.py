"""AgentTokens (pure, a fake clock and source): what a rotation admits and how often the
token source is read."""

from __future__ import annotations

from bulkhead.agent.tokens import AgentTokens
from bulkhead.api.protocol import job_report_token


def test_a_rotation_admits_the_new_and_the_replaced_token_and_reads_are_rate_limited():
    source = {"token": "one", "reads": 0}
    now = [0.0]

    def read() -> str | None:
        source["reads"] += 1
        return source["token"]

    tokens = AgentTokens(read, clock=lambda: now[0], reread_every_s=5)
    assert tokens.admits("one") and tokens.admits(job_report_token("one", "ns.job"), "ns.job")
    assert not tokens.admits("one", "ns.job")  # the agents' token is no job's report token
    source["token"] = "two"
    for _ in range(100):  # a flood of unknown tokens within the interval: no read at all
        assert not tokens.admits("two")
    assert source["reads"] == 1
    now[0] = 5.0
    assert tokens.admits("two") and source["reads"] == 2
    assert tokens.admits(job_report_token("one", "ns.job"), "ns.job")  # made before it
    assert not tokens.admits("three")  # read again only after another interval
    assert source["reads"] == 2
