"""The XID table and kernel-log parsing decide which GPU errors take a node out."""

import pytest

from bulkhead.agent.xid import classify, parse_xid


@pytest.mark.parametrize("code", [48, 64, 74, 79, 95, 119, 120])
def test_hardware_fatal_xids_are_critical(code):
    assert classify(code).severity == "critical"


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_xids_are_info(code):
    assert classify(code).severity == "info"


@pytest.mark.parametrize("code", [63, 92, 94])
def test_recorded_or_contained_memory_events_are_warnings(code):
    assert classify(code).severity == "warning"


def test_unknown_code_is_a_warning_not_ignored():
    info = classify(9999)
    assert info.severity == "warning"
    assert "9999" in info.meaning


@pytest.mark.parametrize(
    ("line", "pci", "code"),
    [
        (
            "[ 9.1] NVRM: Xid (PCI:0000:3B:00): 79, pid=1, GPU has fallen off the bus.",
            "0000:3b:00",
            79,
        ),
        ("kernel: NVRM: Xid (0000:03:00): 48, An uncorrectable double bit error", "0000:03:00", 48),
        (
            "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked",
            "0000:10:1c",
            63,
        ),
    ],
)
def test_parse_xid_lines(line, pci, code):
    event = parse_xid(line)
    assert event is not None
    assert (event.pci, event.info.code) == (pci, code)


def test_non_xid_lines_are_ignored():
    assert parse_xid("NVRM: GPU at PCI:0000:3b:00: GPU-b850f46d") is None
    assert parse_xid("usb 1-1: new high-speed USB device") is None
