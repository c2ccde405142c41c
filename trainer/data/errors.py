"""The error every data problem a user can fix raises (the job fails fast with it)."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data or data settings; the message names the spec field or the file to fix."""
