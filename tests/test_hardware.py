import os
import stat
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from autosymm import hardware


def _props(name="NVIDIA H200", major=9, minor=0, sms=132, n=2):
    return [SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms) for _ in range(n)]


def test_fingerprint_from_stubbed_h200_pair():
    p2p = [[True, True], [True, True]]
    fp = hardware.fingerprint_from_properties(_props(), p2p, (18, 18), driver_version="580.1", cuda_version="13.0")
    assert fp.compute_capability == (9, 0) and fp.sm_count == 132 and fp.gpu_count == 2
    assert fp.links == "nvlink"
    assert fp.hardware_slug == "nvidia-h200-nvlink"
    assert fp.node_slug == "nvidia-h200-nvlink-x2"
    assert fp.topology == "2x NVIDIA H200, NVLink NV18"
    assert fp.as_dict()["node_slug"] == "nvidia-h200-nvlink-x2"


@pytest.mark.parametrize("p2p, nvlinks, expected", [
    ([[True]], (), "single"),
    ([[True, True], [True, True]], (0, 0), "pcie"),
    ([[True, True], [True, True]], (), "unknown"),  # no NVML, no nvidia-smi: not silently 'pcie'
    ([[True, True], [True, True]], (18, 0), "pcie"),
    ([[True, False], [False, True]], (4, 4), "none"),
    ([[True] * 4] * 4, (18,) * 4, "nvlink"),
])
def test_link_class(p2p, nvlinks, expected):
    assert hardware.link_class(list(nvlinks), p2p) == expected


def test_slugs_are_stable_and_safe():
    assert hardware.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert hardware.hardware_slug_for("NVIDIA H200", "nvlink") == "nvidia-h200-nvlink"
    assert hardware.hardware_slug_for("NVIDIA H200", "single") == "nvidia-h200-nvlink"
    assert hardware.hardware_slug_for("NVIDIA L40S", "pcie") == "nvidia-l40s-pcie"
    assert hardware.hardware_slug_for("cpu", "none") == "cpu"
    # an unclassified node matches neither the NVLink nor the PCIe rows
    assert hardware.hardware_slug_for("NVIDIA H200", "unknown") == "nvidia-h200-unknown"


def test_mixed_gpu_models_rejected():
    props = _props(n=1) + _props(name="NVIDIA H100", n=1)
    with pytest.raises(ValueError, match="mixed GPU models"):
        hardware.fingerprint_from_properties(props, [[True, True], [True, True]], ())


def test_cpu_fingerprint_without_gpu(monkeypatch):
    monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: False)
    hardware.fingerprint.cache_clear()
    try:
        fp = hardware.fingerprint()
    finally:
        hardware.fingerprint.cache_clear()
    assert fp.hardware_slug == "cpu" and fp.node_slug == "cpu" and fp.topology == "CPU only"
    assert fp.gpu_count == 0


def test_provenance_has_versions():
    prov = hardware.provenance(hardware.cpu_fingerprint())
    assert prov["autosymm_version"] and prov["torch_version"] and "gpu" in prov


def test_nvidia_ml_py_is_a_declared_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "nvidia-ml-py" for dep in project["dependencies"])


# ------------------------------------------------------------------- nvidia-smi topo -m without NVML

H200_X2 = """\
\t\x1b[4mGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tSYS\tSYS\t0-47,96-143\t0\t\tN/A
GPU1\tNV18\t X \tSYS\tSYS\t48-95,144-191\t1\t\tN/A
NIC0\tSYS\tSYS\t X \tPIX\t\t\t\t
NIC1\tSYS\tSYS\tPIX\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

PCIE_X4 = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      PIX     PHB     SYS     0-31    0               N/A
GPU1    PIX      X      PHB     SYS     0-31    0               N/A
GPU2    PHB     PHB      X      SYS     0-31    0               N/A
GPU3    SYS     SYS     SYS      X      32-63   1               N/A

Legend:
  X    = Self
  PIX  = Connection traversing at most a single PCIe bridge
"""

BRIDGED_PAIRS_X4 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tNODE\tSYS\t0-15\t0
GPU1\tNV4\t X \tPXB\tSYS\t0-15\t0
GPU2\tNODE\tPXB\t X \tNV4\t16-31\t1
GPU3\tSYS\tSYS\tNV4\t X \t16-31\t1
"""

NVSWITCH_X8 = "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\tCPU Affinity\n" + "".join(
    f"GPU{i}\t" + "\t".join(" X " if i == j else "NV18" for j in range(8)) + "\t0-55\n" for i in range(8))


def test_parse_topo_matrix_of_nvlink_and_pcie_nodes():
    assert hardware.parse_topo_matrix(H200_X2) == [["X", "NV18"], ["NV18", "X"]]
    assert hardware.parse_topo_matrix(PCIE_X4)[0] == ["X", "PIX", "PHB", "SYS"]
    assert hardware.parse_topo_matrix(PCIE_X4)[3] == ["SYS", "SYS", "SYS", "X"]
    assert len(hardware.parse_topo_matrix(NVSWITCH_X8)) == 8


@pytest.mark.parametrize("text", [
    "", "No devices were found\n", "NVIDIA-SMI has failed because it couldn't communicate with the driver.\n",
    H200_X2.replace("NV18\t X", "??\t X"),      # a cell nvidia-smi never prints
    H200_X2.replace("GPU1\tNV18", "GPU7\tNV18"),  # a row missing
    H200_X2.replace(" X \tNV18", "NV18\tNV18", 1),  # no 'X' on the diagonal
])
def test_parse_topo_matrix_rejects_what_is_not_a_matrix(text):
    assert hardware.parse_topo_matrix(text) is None


@pytest.mark.parametrize("text, gpus, indices, counts, links", [
    (H200_X2, 2, [0, 1], (18, 18), "nvlink"),
    (H200_X2, 2, None, (18, 18), "nvlink"),
    (NVSWITCH_X8, 8, None, (18,) * 8, "nvlink"),
    (NVSWITCH_X8, 2, [3, 6], (18, 18), "nvlink"),
    (PCIE_X4, 4, [0, 1, 2, 3], (0, 0, 0, 0), "pcie"),
    (PCIE_X4, 2, [0, 1], (0, 0), "pcie"),
    (BRIDGED_PAIRS_X4, 2, [0, 1], (4, 4), "nvlink"),  # CUDA_VISIBLE_DEVICES=0,1: the bridged pair
    (BRIDGED_PAIRS_X4, 2, [0, 2], (0, 0), "pcie"),
    (BRIDGED_PAIRS_X4, 2, None, (), "unknown"),  # visible GPUs unknown and pairs differ: no answer
    (H200_X2, 2, [0, 5], (), "unknown"),  # an index the matrix does not have
    ("garbage", 2, [0, 1], (), "unknown"),
])
def test_nvlink_counts_from_topo(text, gpus, indices, counts, links):
    assert hardware.nvlink_counts_from_topo(text, gpus, indices) == counts
    assert hardware.link_class(list(counts), [[True] * gpus] * gpus) == links


@pytest.mark.parametrize("env, gpus, expected", [
    (None, 2, [0, 1]), ("2,3", 2, [2, 3]), ("4, 6,7", 2, [4, 6]), ("GPU-1a2b,GPU-3c4d", 2, None), ("0", 2, None),
])
def test_visible_indices(monkeypatch, env, gpus, expected):
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert hardware._visible_indices(gpus) == expected


def _fake_nvidia_smi(tmp_path, body: str) -> Path:
    """A directory whose only program is an `nvidia-smi` shell script running ``body``."""
    folder = tmp_path / "bin"
    folder.mkdir()
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def test_topo_text_runs_nvidia_smi(tmp_path, monkeypatch):
    (tmp_path / "out.txt").write_text(H200_X2)
    script = f'[ "$1 $2" = "topo -m" ] && cat {tmp_path}/out.txt'
    monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path, script)) + os.pathsep + os.environ["PATH"])
    assert hardware._topo_text() == (H200_X2, "")


def test_topo_text_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hardware._topo_text() == ("", "nvidia-smi is not on PATH")


def test_topo_text_failing_nvidia_smi(tmp_path, monkeypatch):
    script = "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\" >&2; exit 9"
    monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path, script)) + os.pathsep + os.environ["PATH"])
    text, why = hardware._topo_text()
    assert text == "" and "exited with 9" in why and "couldn't communicate" in why


def test_topo_text_gives_up_on_a_hanging_nvidia_smi(tmp_path, monkeypatch):
    # the sleep is a grandchild holding the output pipe: the whole process group must go
    monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path, "sleep 60 & wait")) + os.pathsep + os.environ["PATH"])
    start = time.monotonic()
    text, why = hardware._topo_text(timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert text == "" and "no answer within 0.5 s" in why


# ------------------------------------------------------------------- fingerprint() without NVML


@pytest.fixture
def two_stub_gpus(monkeypatch):
    """torch.cuda stubbed as two H200s with peer access; NVML answers nothing."""
    cuda = hardware.torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: _props(n=1)[0])
    monkeypatch.setattr(cuda, "can_device_access_peer", lambda i, j: True)
    monkeypatch.setattr(hardware, "_driver_version", lambda: "")
    monkeypatch.setattr(hardware, "_nvml_nvlink_counts", lambda n: ((), "NVML: nvidia-ml-py is not importable"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hardware, "_WARNED_UNCLASSIFIED", set())
    hardware.fingerprint.cache_clear()
    yield
    hardware.fingerprint.cache_clear()


def test_fingerprint_without_nvml_reads_nvidia_smi_topo(two_stub_gpus, monkeypatch):
    monkeypatch.setattr(hardware, "_topo_text", lambda: (H200_X2, ""))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp = hardware.fingerprint()
    assert fp.links == "nvlink" and fp.hardware_slug == "nvidia-h200-nvlink" and fp.nvlink_counts == (18, 18)
    assert fp.topology == "2x NVIDIA H200, NVLink NV18"


def test_fingerprint_prefers_nvml(two_stub_gpus, monkeypatch):
    monkeypatch.setattr(hardware, "_nvml_nvlink_counts", lambda n: ((0, 0), ""))
    monkeypatch.setattr(hardware, "_topo_text", lambda: pytest.fail("nvidia-smi asked although NVML answered"))
    assert hardware.fingerprint().hardware_slug == "nvidia-h200-pcie"


def test_unclassified_node_is_unknown_and_warned_once(two_stub_gpus, monkeypatch):
    monkeypatch.setattr(hardware, "_topo_text", lambda: ("", "nvidia-smi is not on PATH"))
    with pytest.warns(hardware.UnclassifiedLinksWarning) as record:
        fp = hardware.fingerprint()
    assert fp.links == "unknown" and fp.hardware_slug == "nvidia-h200-unknown" and fp.node_slug == "nvidia-h200-unknown-x2"
    (message,) = [str(w.message) for w in record]
    for part in ("nvidia-ml-py is not importable", "nvidia-smi is not on PATH", "pip install nvidia-ml-py", "NCCL"):
        assert part in message
    hardware.fingerprint.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hardware.fingerprint().links == "unknown"  # once per process


def test_unparseable_topo_output_is_unknown_with_its_reason(two_stub_gpus, monkeypatch):
    monkeypatch.setattr(hardware, "_topo_text", lambda: ("No devices were found\n", ""))
    with pytest.warns(hardware.UnclassifiedLinksWarning, match="printed no GPU matrix"):
        assert hardware.fingerprint().links == "unknown"
