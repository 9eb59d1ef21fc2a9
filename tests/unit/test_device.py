"""The verifier's device, on any machine: which one `--device` names, what CUDA is set to for exactness,
where admission's KV budget comes from, and what `doctor` says of GPUs. The GPUs are injected: CI's
machines have none (docs/gpu.md)."""

from __future__ import annotations

import argparse
import io
import os

import pytest
import torch

from draftwire_cli import doctor
from draftwire_cli.cliargs import device_name
from verifier_service import cuda
from verifier_service.admission import AdmissionConfig
from verifier_service.numerics import NoSuchDevice, resolve_device
from verifier_service.stream import available_memory, sized


@pytest.mark.parametrize(
    ("requested", "gpus", "device"),
    [
        ("auto", 0, "cpu"),
        (None, 0, "cpu"),
        ("auto", 2, "cuda:0"),
        ("cpu", 2, "cpu"),
        ("cuda", 1, "cuda:0"),
        ("CUDA:1", 2, "cuda:1"),
    ],
)
def test_a_device_name_resolves_to_a_torch_device(requested, gpus, device):
    assert resolve_device(requested, gpus) == device


@pytest.mark.parametrize(
    ("requested", "gpus", "said"),
    [
        ("cuda", 0, "sees 0 CUDA devices"),
        ("cuda:2", 2, "sees 2"),
        ("gpu", 1, "unknown device"),
        ("cuda:x", 1, "unknown device"),
    ],
)
def test_a_device_that_is_not_there_is_refused_in_one_line(requested, gpus, said):
    with pytest.raises(NoSuchDevice, match=said) as refused:
        resolve_device(requested, gpus)
    assert "\n" not in str(refused.value) and "choose" in str(refused.value)


def test_the_flag_takes_the_names_and_refuses_others():
    assert [device_name(n) for n in ("auto", "cpu", "cuda", "cuda:3", " CUDA:0 ")] == [
        "auto",
        "cpu",
        "cuda",
        "cuda:3",
        "cuda:0",
    ]
    for bad in ("gpu", "cuda:", "cuda:-1", "mps", "cpu:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            device_name(bad)


@pytest.fixture
def cuda_settings(monkeypatch):
    """CUDA's global settings, put back after the test (cuda.determinism sets them process-wide)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with cuda.CudaSettings.read().applied():
        yield


def test_cuda_is_set_for_the_same_bits_every_call(cuda_settings):
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32 = matmul.allow_bf16_reduced_precision_reduction = True  # what a user's code may set
    torch.backends.cudnn.allow_tf32 = True
    cuda.determinism()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == cuda.CUBLAS_WORKSPACE
    assert not matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert not matmul.allow_fp16_reduced_precision_reduction
    assert not matmul.allow_bf16_reduced_precision_reduction
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark


def test_an_operators_cublas_workspace_is_kept(cuda_settings, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other documented deterministic size
    cuda.determinism()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_kv_budget_on_a_gpu_is_half_its_free_memory(monkeypatch):
    asked = []

    def mem_get_info(device=None):
        asked.append(torch.device(device))
        return 30 << 30, 141 << 30  # free, total: another process holds the rest

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert available_memory("cuda:1") == 30 << 30
    assert sized(AdmissionConfig(), "cuda:1").kv_budget_bytes == 15 << 30
    assert asked == [torch.device("cuda:1")] * 2  # the device the caches live on, not the first GPU
    assert sized(AdmissionConfig(), "cpu").kv_budget_bytes < 2 * available_memory("cpu")  # not the GPU's
    assert len(asked) == 2


H200 = {"index": 0, "name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8, "free_gib": 139.1}


def test_doctor_names_each_gpu_and_the_exact_dtypes_its_load_tries():
    report = doctor.device_report([dict(H200)])
    assert report["auto"] == "cuda:0"
    [gpu] = report["gpus"]
    assert gpu["exact_dtypes"] == ["bfloat16", "float32"] and gpu["kernels"] == "portable-NVIDIA_H200"
    out = io.StringIO()
    doctor._print_devices(report, out)
    text = out.getvalue()
    assert "--device auto takes cuda:0" in text and "NVIDIA H200" in text and "139.8 GiB" in text


def test_doctor_without_a_gpu_says_the_cpu_is_used_and_why():
    report = doctor.device_report([])
    assert report["auto"] == "cpu" and report["gpus"] == []
    out = io.StringIO()
    doctor._print_devices(report, out)
    expected = "no GPU visible" if torch.version.cuda else "torch is built for the CPU alone"
    assert out.getvalue().startswith("devices    --device auto takes cpu") and expected in out.getvalue()
