"""The membership view as the control endpoint sends it: encoded once per view.

When a generation is published every worker's long poll answers at once; at 16,384
members the view's JSON is ~1.7 MB, so encoding it per request made a membership change
cost workers x members. ``ViewEncodings`` keeps, per job session, the current view's
``EncodedView`` (JSON, gzip and deltas, each made once) and the views published lately,
which a client may hold and get a delta against. HTTP's business, not the session's: the
session only says which view is current.
"""

from __future__ import annotations

import gzip
import json
import weakref

from bulkhead.api.protocol import MembershipView, membership_delta

# Views a client may still hold and get a delta against: a worker that missed a few
# generations (busy in a long step) still gets a delta, an older one the full view.
RECENT_VIEWS = 3


def view_etag(view: MembershipView) -> str:
    return f'"g{view.generation}-{view.state}"'


class EncodedView:
    """One published view encoded once, for every poller: JSON bytes, gzip on demand.

    At 16,384 members the JSON is ~1.7 MB; encoding it per request made a membership
    change cost workers x members. ``etag`` names the view (generation and state: a
    generation number never names two memberships, and within one only the state moves).
    """

    def __init__(self, view: MembershipView) -> None:
        self.view = view
        self.etag = view_etag(view)
        self.body = view.model_dump_json(by_alias=True).encode()
        self._gzipped: bytes | None = None
        self._deltas: dict[str, bytes] = {}  # base ETag -> gzipped delta

    def delta_from(self, base: MembershipView) -> bytes:
        """This view as a gzipped delta against ``base``, made once per base."""
        key = view_etag(base)
        if key not in self._deltas:
            delta = json.dumps(membership_delta(base, self.view), separators=(",", ":"))
            self._deltas[key] = gzip.compress(delta.encode(), compresslevel=1, mtime=0)
        return self._deltas[key]

    @property
    def gzipped(self) -> bytes:
        if self._gzipped is None:
            # Level 1: member lists are repetitive, so even the fastest level shrinks them
            # ~8x, in a few ms once per view.
            self._gzipped = gzip.compress(self.body, compresslevel=1, mtime=0)
        return self._gzipped


class _JobViews:
    def __init__(self) -> None:
        self.current: EncodedView | None = None
        self.recent: dict[str, MembershipView] = {}  # ETag -> a view published lately


class ViewEncodings:
    """The encodings of each session's views; a session that is gone takes its own along."""

    def __init__(self) -> None:
        self._jobs: weakref.WeakKeyDictionary[object, _JobViews] = weakref.WeakKeyDictionary()

    def encoded(self, session: object, view: MembershipView) -> EncodedView:
        """``view`` (``session``'s current one) encoded, once however many ask."""
        views = self._jobs.setdefault(session, _JobViews())
        if views.current is None or views.current.view is not view:
            if views.current is not None:
                views.recent[views.current.etag] = views.current.view
                while len(views.recent) > RECENT_VIEWS:
                    del views.recent[next(iter(views.recent))]
            views.current = EncodedView(view)
        return views.current

    def recent(self, session: object, etag: str) -> MembershipView | None:
        """A view of ``session`` published lately, by its ETag (a delta's base), if kept."""
        views = self._jobs.get(session)
        return views.recent.get(etag) if views is not None else None
