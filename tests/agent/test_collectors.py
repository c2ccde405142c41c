"""Collectors read real files (a /proc tree, a followed log) and replayed GPU traces."""

import pytest

from bulkhead.agent.collectors.base import GpuSample
from bulkhead.agent.collectors.gpu import GpuCollector, TraceGpuSource, open_source
from bulkhead.agent.collectors.host import HostCollector
from bulkhead.agent.collectors.kernel_log import FileFollowSource, XidCollector
from bulkhead.agent.collectors.training import TrainingCollector
from bulkhead.api.protocol import WorkerReport

MEMINFO = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n"
NET_DEV = (
    "Inter-|   Receive                            |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes packets errs drop\n"
    "  eth0: 100 10 2 1 0 0 0 0 200 20 3 4 0 0 0 0\n"
    "    lo: 5 5 0 0 0 0 0 0 5 5 0 0 0 0 0 0\n"
)


def _proc(root, user: int, idle: int) -> None:
    (root / "net").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1\n")
    (root / "meminfo").write_text(MEMINFO)
    (root / "loadavg").write_text("1.50 1.00 0.50 1/100 42\n")
    (root / "diskstats").write_text(
        "   8       0 sda 1 0 0 0 0 0 0 0 0 700 0\n   7       0 loop0 1 0 0 0 0 0 0 0 0 99 0\n"
    )
    (root / "net" / "dev").write_text(NET_DEV)


def test_host_collector_parses_a_proc_tree(tmp_path):
    _proc(tmp_path, user=100, idle=300)
    host = HostCollector(tmp_path)
    first = host.collect()
    assert first.memory_available_frac == pytest.approx(0.25)
    assert first.load1 == 1.5
    assert first.net_errors_total == 2 + 1 + 3 + 4
    assert first.disk_io_ms_total == 700  # loop devices are skipped
    _proc(tmp_path, user=175, idle=325)  # 75 busy of 100 jiffies
    assert host.collect().cpu_busy_frac == pytest.approx(0.75)


def test_host_collector_survives_a_missing_proc(tmp_path):
    sample = HostCollector(tmp_path / "absent").collect()
    assert sample.memory_available_frac == 1.0 and sample.cpu_busy_frac == 0.0


def test_kernel_log_follow_from_end_with_partial_lines_and_rotation(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:01:00): 79, old event before the agent started\n")
    xids = XidCollector(FileFollowSource(log))
    assert xids.collect() == []
    with log.open("a") as f:
        f.write("NVRM: Xid (PCI:0000:01:00): 48, DBE\nNVRM: Xid (PCI:0000:01:00): 7")
    assert [e.info.code for e in xids.collect()] == [48]
    with log.open("a") as f:
        f.write("4, NVLink\n")  # completes the partial line
    assert [e.info.code for e in xids.collect()] == [74]
    log.rename(tmp_path / "kern.log.1")  # rotation: a new file from the start
    log.write_text("NVRM: Xid (PCI:0000:02:00): 95, Uncontained\n")
    assert [e.info.code for e in xids.collect()] == [95]


def test_trace_gpu_source_replays_and_tracks_the_expected_count():
    trace = [[GpuSample(index=0), GpuSample(index=1)], [GpuSample(index=0)]]
    gpus = GpuCollector(TraceGpuSource(trace))
    assert len(gpus.collect()) == 2
    assert len(gpus.collect()) == 1
    assert len(gpus.collect()) == 1  # the last tick repeats
    assert gpus.expected == 2


def test_nvml_auto_without_a_driver_means_no_gpus_and_nvml_mode_fails():
    assert open_source("auto").read() == []
    with pytest.raises(RuntimeError, match="NVML is unavailable"):
        open_source("nvml")


def test_training_collector_tracks_progress_and_forgets():
    training = TrainingCollector(forget_after_s=100)
    training.record(WorkerReport(worker="w0", step=1, loss=2.0), now=10)
    training.record(WorkerReport(worker="w0", step=1, loss=2.0), now=20)
    training.record(WorkerReport(worker="w1", step=7), now=20)
    states = {s.worker: s for s in training.collect(now=30)}
    assert states["w0"].last_progress == 10 and states["w0"].last_report == 20
    training.record(WorkerReport(worker="w0", step=2), now=40)
    assert {s.worker: s for s in training.collect(now=40)}["w0"].last_progress == 40
    training.record(WorkerReport(worker="w1", step=8, done=True), now=41)
    assert [s.worker for s in training.collect(now=41)] == ["w0"]
    assert training.collect(now=200) == []
