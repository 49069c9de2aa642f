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
    ([[True, True], [True, True]], (), "pcie"),
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
