"""Labels each member pod with the generation it trains in, in the background.

``kubectl get pods -l bulkhead.dev/generation=N`` lists generation N's members. Every new
generation changes that label on every member, so a generation of a 1,000-worker job is
1,000 pod PATCHes; sent at once they took every slot of the client and held a bad node's
taint and its replacement pod behind them for 17 s (issue 42). So the labels are
bookkeeping that nobody waits on:

- one task per job sends them, a few at a time, in the client's ``background`` lane;
- only the newest generation of each pod is ever sent: a generation published while the
  previous one is still being labelled replaces it, pods that left the membership are
  dropped, and a pod already labelled with its generation costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bulkhead.api.status import Membership
from bulkhead.operator.k8s import names
from bulkhead.operator.k8s.kube import BACKGROUND_CONCURRENCY, KubeClient, KubeError, core_path

log = logging.getLogger(__name__)


class GenerationLabels:
    """The generation label of one job's member pods, kept up to date by one task."""

    def __init__(self, client: KubeClient, namespace: str) -> None:
        self._client = client
        self._namespace = namespace
        self._wanted: dict[str, int] = {}  # member pod -> its generation
        self._labeled: dict[str, int] = {}  # pod -> the generation its label says
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def follow(self, membership: Membership) -> None:
        """The members of ``membership`` should carry its generation (never blocks)."""
        if not membership.generation:
            return
        self._wanted = {m.worker: membership.generation for m in membership.members}
        self._labeled = {p: g for p, g in self._labeled.items() if p in self._wanted}
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"labels {self._namespace}")

    def pending(self) -> int:
        """Member pods whose label is not (yet) their generation."""
        return sum(1 for pod, gen in self._wanted.items() if self._labeled.get(pod) != gen)

    async def _run(self) -> None:
        while True:
            todo = [(p, g) for p, g in self._wanted.items() if self._labeled.get(p) != g]
            if not todo:
                self._wake.clear()
                await self._wake.wait()
                continue
            # A batch as wide as the lane; then the wanted map is read again, so a newer
            # generation takes over from the rest of an older one.
            batch = todo[:BACKGROUND_CONCURRENCY]
            await asyncio.gather(*(self._label(pod, gen) for pod, gen in batch))

    async def _label(self, pod: str, generation: int) -> None:
        path = core_path("pods", self._namespace, pod)
        patch = {"metadata": {"labels": {names.LABEL_GENERATION: str(generation)}}}
        try:
            await self._client.merge_patch(path, patch, lane="background")
        except KubeError as exc:
            if exc.status != 404:  # a pod already gone needs no label
                log.warning("labelling pod %s with generation %d: %s", pod, generation, exc)
                await asyncio.sleep(1.0)  # a refusal: try again later, not in a busy loop
                return
        except Exception as exc:  # an outage: the same, never lose the task
            log.warning("labelling pod %s with generation %d: %s", pod, generation, exc)
            await asyncio.sleep(1.0)
            return
        self._labeled[pod] = generation

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
