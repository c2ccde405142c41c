"""NVIDIA XID codes: what each means and whether it takes the node out of training.

Meanings follow NVIDIA's published XID catalog (docs.nvidia.com/deploy/xid-errors). The
classification is ours, from the catalog's "immediate action" buckets:

- ``critical``: the GPU (or its memory / links) is broken until a reset, reboot or RMA:
  the node must leave the job;
- ``warning``: a hardware signal worth surfacing that does not stop the GPU by itself
  (a recorded row remap, a high corrected-error rate, a contained ECC error that killed
  only the process that touched the page);
- ``info``: usually the application's own fault (bad kernel, illegal address) or cleanup
  after another error; never a reason to evict a node.

Unknown codes are ``warning``: new driver codes should be seen, not silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bulkhead.api.spec import Severity


@dataclass(frozen=True)
class XidInfo:
    code: int
    meaning: str
    severity: Severity


_TABLE: dict[int, tuple[str, Severity]] = {
    8: ("GPU stopped processing (channel idle timeout)", "info"),
    11: ("Invalid or corrupted push buffer stream", "info"),
    13: ("Graphics engine exception (usually an application error)", "info"),
    31: ("GPU memory page fault (usually an illegal access by the application)", "info"),
    43: ("GPU stopped processing (application channel reset)", "info"),
    45: ("Preemptive cleanup after a previous error or process exit", "info"),
    46: ("GPU stopped processing", "critical"),
    48: ("Double bit ECC error (DBE)", "critical"),
    61: ("Internal micro-controller breakpoint/warning", "warning"),
    62: ("Internal micro-controller halt", "critical"),
    63: ("ECC page retirement or row remapping recording event", "warning"),
    64: ("ECC page retirement or row remapper recording failure", "critical"),
    68: ("Video processor exception", "info"),
    69: ("Graphics engine class error", "info"),
    74: ("NVLink error", "critical"),
    79: ("GPU has fallen off the bus", "critical"),
    92: ("High single-bit ECC error rate", "warning"),
    94: ("Contained ECC error", "warning"),
    95: ("Uncontained ECC error", "critical"),
    109: ("Context switch timeout", "info"),
    119: ("GSP RPC timeout", "critical"),
    120: ("GSP error", "critical"),
    121: ("C2C link error", "critical"),
    140: ("Unrecovered ECC error", "critical"),
    143: ("GPU initialization failure", "critical"),
    154: ("GPU recovery action changed (reset or reboot required)", "critical"),
}


def classify(code: int) -> XidInfo:
    """The meaning and severity of an XID code; unknown codes are warnings."""
    meaning, severity = _TABLE.get(code, (f"unknown XID {code}", "warning"))
    return XidInfo(code, meaning, severity)


# "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus."
# Older drivers omit "PCI:"; some print "Xid (0000:03:00): 14, Channel 00000001".
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<code>\d+)")


@dataclass(frozen=True)
class XidEvent:
    pci: str
    info: XidInfo
    line: str


def parse_xid(line: str) -> XidEvent | None:
    """The XID event in one kernel log line, or None if the line is not an XID report."""
    match = _XID_LINE.search(line)
    if match is None:
        return None
    return XidEvent(match["pci"].lower(), classify(int(match["code"])), line.strip())
