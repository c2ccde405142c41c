"""A stand-in trainer process of a multi-process pod (the real one needs torch): it checks in
with its pod's relay, then does what ``POD_CHILD_BEHAVIOURS`` (one per local rank) says:
``exit:N`` exits with code N, ``poll`` long-polls membership until killed (30 s polls, so a
poll is open whenever the pod ends), ``stop`` SIGSTOPs itself (a wedged process). With
``--template`` it is the pod's template (``worker.template_main``'s stand-in): it forks a
process per request that does the above with the request's environment."""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from bulkhead.api.client import HttpControlClient
from bulkhead.api.protocol import LOCAL_RANK_ENV, RegisterRequest
from bulkhead.trainer.pod.prestart import serve_forks


def main() -> None:
    rank = int(os.environ[LOCAL_RANK_ENV])
    behaviour = os.environ["POD_CHILD_BEHAVIOURS"].split(",")[rank]
    client = HttpControlClient.from_env()
    assert client.worker is not None
    client.register(RegisterRequest(worker=client.worker, address=f"127.0.0.1:{7100 + rank}"))
    client.membership(after=0, timeout_s=0)
    if behaviour.startswith("exit:"):
        sys.exit(int(behaviour.removeprefix("exit:")))
    if behaviour == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        client.membership(after=10_000, timeout_s=30)


def _become(env: dict[str, str], handed_over: float) -> NoReturn:
    os.environ.clear()
    os.environ.update(env)
    main()
    os._exit(0)


if __name__ == "__main__":
    if "--template" in sys.argv:
        serve_forks(lambda: None, _become)
    main()
