"""`--dtype auto` and the numerics identity (verifier_service/numerics.py), with the hardware injected so that
every branch runs on every machine; then the load-time proof on a real (tiny) target on this CPU."""

from pathlib import Path

import pytest
import torch

from draftwire.contract import Numerics
from verifier_service import families, numerics
from verifier_service.engine import TargetEngine
from verifier_service.families import UnsupportedModel
from verifier_service.invariant import NotInvariant
from verifier_service.numerics import Hardware, NoExactPath

AVX2 = frozenset("sse4_1 sse4_2 avx avx2 fma f16c".split())
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = AVX512 | {"avx512_bf16", "avx512_vnni"}
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}

AVX2_CPU = Hardware(cpu_flags=AVX2, onednn_bf16=False)
AVX512_CPU = Hardware(cpu_flags=AVX512, onednn_bf16=True)  # oneDNN emulates bfloat16 here
ZEN4_CPU = Hardware(cpu_flags=ZEN4, onednn_bf16=True)
SPR_CPU = Hardware(cpu_flags=SPR, onednn_bf16=True)
GPU = Hardware(device="cuda", cpu_flags=AVX2)
NO_ONEDNN = Hardware(cpu_flags=AVX2, onednn=False)


@pytest.mark.parametrize(
    "hardware, requested, exact, expected",
    [
        (AVX2_CPU, "auto", True, ["float32"]),
        (AVX2_CPU, "float32", True, ["float32"]),
        (AVX512_CPU, "auto", True, ["float32"]),
        (AVX512_CPU, "bfloat16", True, ["bfloat16"]),
        (ZEN4_CPU, "auto", True, ["bfloat16", "float32"]),
        (ZEN4_CPU, "bfloat16", True, ["bfloat16"]),
        (ZEN4_CPU, "float32", True, ["float32"]),
        (SPR_CPU, "auto", True, ["bfloat16", "float32"]),
        (AVX2_CPU, "auto", False, ["float32"]),
        (AVX2_CPU, "bfloat16", False, ["bfloat16"]),
        (ZEN4_CPU, "auto", False, ["bfloat16"]),
        (GPU, "auto", False, ["bfloat16"]),
        (GPU, "float32", False, ["float32"]),
        (GPU, "auto", True, ["bfloat16", "float32"]),  # the portable kernels; the proof decides
        (GPU, "float32", True, ["float32"]),
        (NO_ONEDNN, "auto", True, ["float32"]),
    ],
)
def test_plan_lists_the_dtypes_to_try_best_first(hardware, requested, exact, expected):
    assert numerics.plan(requested, hardware, exact) == expected
    assert numerics.plan(requested, hardware, exact, "portable") == expected


def test_bfloat16_on_a_cpu_without_its_kernels_is_refused_naming_the_missing_features():
    with pytest.raises(NoExactPath) as refused:
        numerics.plan("bfloat16", AVX2_CPU, exact=True)
    message = str(refused.value)
    assert "lacks avx512bw, avx512vl, avx512dq, avx_ne_convert" in message
    assert "--dtype float32" in message and "--no-bit-exact" in message
    assert "\n" not in message


def test_the_missing_features_are_those_the_cpu_lacks():
    partial = Hardware(cpu_flags=AVX2 | {"avx512f", "avx512bw"}, onednn_bf16=False)
    assert partial.missing_for_bf16 == ("avx512vl", "avx512dq", "avx_ne_convert")
    assert ZEN4_CPU.missing_for_bf16 == ()


@pytest.mark.parametrize("hardware", [GPU, NO_ONEDNN])
def test_onednn_where_it_has_no_kernels_is_refused_with_the_ways_out(hardware):
    with pytest.raises(NoExactPath, match="--kernels portable.*--no-bit-exact"):
        numerics.plan("auto", hardware, exact=True, kernels="onednn")


def test_bfloat16_without_onednn_is_refused():
    with pytest.raises(NoExactPath, match="--dtype float32"):
        numerics.plan("bfloat16", NO_ONEDNN, exact=True)
    with pytest.raises(ValueError, match="unknown kernels"):
        numerics.plan("auto", AVX2_CPU, exact=True, kernels="triton")


def test_an_unknown_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="float16"):
        numerics.plan("float16", AVX2_CPU, exact=True)


@pytest.mark.parametrize(
    "flags, machine, isa",
    [
        (AVX2, "x86_64", "avx2"),
        (AVX2 | {"avx_vnni"}, "x86_64", "avx2_vnni"),
        (AVX512, "x86_64", "avx512_core"),
        (ZEN4, "x86_64", "avx512_core_bf16"),
        (SPR, "x86_64", "avx512_core_amx"),
        (frozenset({"sse4_1"}), "x86_64", "sse41"),
        (frozenset(), "x86_64", "x64"),
        (frozenset({"asimd"}), "aarch64", "asimd"),
        (frozenset({"asimd", "sve"}), "aarch64", "sve"),
    ],
)
def test_kernel_class_names_the_isa_that_decides_the_bits(flags, machine, isa):
    hardware = Hardware(cpu_flags=flags, machine=machine)
    assert hardware.kernel_class(exact=True) == f"onednn-{isa}"
    assert hardware.kernel_class(exact=True, kernels="portable") == f"portable-{isa}"


def test_a_gpu_is_named_by_its_model():
    h200 = Hardware(device="cuda", accelerator="NVIDIA_H200")
    a100 = Hardware(device="cuda", accelerator="NVIDIA_A100-SXM4-80GB")
    assert h200.numerics("bfloat16", True).identity == "bfloat16/portable-NVIDIA_H200/cuda/exact"
    assert h200.numerics("bfloat16", True) != a100.numerics("bfloat16", True)
    assert GPU.kernel_class(exact=False) == "aten-cuda"


def test_numerics_identity_separates_what_changes_the_bits():
    identities = {
        AVX2_CPU.numerics("float32", True).identity,
        AVX2_CPU.numerics("float32", False).identity,
        ZEN4_CPU.numerics("float32", True).identity,
        ZEN4_CPU.numerics("bfloat16", True).identity,
        SPR_CPU.numerics("bfloat16", True).identity,
        SPR_CPU.numerics("bfloat16", True, "portable").identity,
        GPU.numerics("bfloat16", False).identity,
    }
    assert len(identities) == 7
    n = SPR_CPU.numerics("bfloat16", True)
    assert n.identity == "bfloat16/onednn-avx512_core_amx/cpu/exact"
    assert Numerics.parse(n.identity) == n
    for bad in ("", "float32/x/cpu", "float32/x/cpu/maybe", "a//b/exact"):
        with pytest.raises(ValueError):
            Numerics.parse(bad)


def test_cpu_flags_reads_x86_and_arm_cpuinfo(tmp_path: Path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert numerics.cpu_flags(x86) == {"fpu", "avx2", "avx512f"}
    assert numerics.cpu_flags(arm) == {"fp", "asimd", "sve"}
    assert numerics.cpu_flags(tmp_path / "none") == frozenset()


def test_detect_agrees_with_torch_on_this_machine():
    hardware = Hardware.detect("cpu")
    assert hardware.onednn_bf16 == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not hardware.onednn_bf16:
        assert hardware.missing_for_bf16  # a CPU without the kernels lacks something we can name


# --- the load-time proof, on a real tiny target on this CPU ---


@pytest.fixture(scope="module")
def target_dir(test_pair):
    return test_pair.target_dir


def test_auto_loads_an_exact_path_and_says_which(target_dir):
    engine = TargetEngine.load(target_dir, dtype="auto")
    hardware = Hardware.detect("cpu")
    assert engine.invariant and engine.numerics.exact
    assert engine.numerics.kernels == hardware.kernel_class(True, engine.kernels)
    assert engine.numerics.dtype == str(engine.model.dtype).removeprefix("torch.")
    if not hardware.onednn_bf16:
        assert engine.numerics.dtype == "float32"
    engine.check_invariance(gamma=7, seed=3)  # the proof holds for other shapes too


def test_auto_falls_back_to_float32_where_the_bfloat16_proof_fails(target_dir, monkeypatch):
    """A CPU that claims bfloat16 kernels (injected) whose proof fails: auto passes over bfloat16, says
    why, and serves float32."""
    real = TargetEngine.check_invariance

    def bf16_fails(self, *args, **kwargs):
        if self.numerics.dtype == "bfloat16":
            raise NotInvariant("bfloat16 logits inside a batch differ (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TargetEngine, "check_invariance", bf16_fails)
    monkeypatch.setattr(TargetEngine, "__init__", _skipping_bf16_kernel_check(TargetEngine.__init__))
    claims = Hardware(cpu_flags=ZEN4, onednn_bf16=True)
    engine = TargetEngine.load(target_dir, dtype="auto", hardware=claims)
    assert engine.numerics.dtype == "float32"
    assert engine.passed_over and "bfloat16" in engine.passed_over[0] and "injected" in engine.passed_over[0]


def test_a_dtype_whose_proof_fails_is_refused_not_served(target_dir, monkeypatch):
    def fails(self, *args, **kwargs):
        raise NotInvariant("float32 logits inside a γ + 1 forward differ (injected)")

    monkeypatch.setattr(TargetEngine, "check_invariance", fails)
    with pytest.raises(NoExactPath, match="--no-bit-exact") as refused:
        TargetEngine.load(target_dir, dtype="float32")
    assert "injected" in str(refused.value)


def _errors(monkeypatch, errors: list[float]) -> list[float]:
    """families.relative_error giving `errors` in turn, one per forward of the model's own that the
    conformance check compares with (eager, then sdpa); returns the list of those it gave."""
    given = []

    def scripted(ours, own):
        given.append(errors[len(given)])
        return given[-1]

    monkeypatch.setattr(families, "relative_error", scripted)
    return given


def test_conformance_takes_the_sdpa_forward_where_the_eager_one_misses(target_dir, monkeypatch):
    """transformers' eager attention rounds bfloat16 scores before the softmax (Qwen2.5-1.5B's own logits
    were 0.106 of their range off float32 that way, 0.019 through sdpa): an engine within tolerance of
    the sdpa forward is served; one that misses both is refused with the nearer figure."""
    engine = TargetEngine.load(target_dir, dtype="float32")
    given = _errors(monkeypatch, [0.5, 1e-6])
    engine.check_conformance()
    assert given == [0.5, 1e-6]
    given = _errors(monkeypatch, [0.5, 0.25])
    with pytest.raises(UnsupportedModel, match="off by 2.5e-01 of their range in float32"):
        engine.check_conformance()
    given = _errors(monkeypatch, [1e-6])
    engine.check_conformance()
    assert given == [1e-6]  # eager met: no second forward
    assert engine.model.config._attn_implementation == "draftwire_rows"  # the engine's own, after


def test_a_soft_capped_model_is_checked_against_eager_alone(target_dir, monkeypatch):
    """sdpa drops Gemma 2's cap on the scores, so it is no reference for a capped model."""
    engine = TargetEngine.load(target_dir, dtype="float32")
    monkeypatch.setattr(engine.model.config, "attn_logit_softcapping", 50.0, raising=False)
    given = _errors(monkeypatch, [0.5, 1e-6])
    with pytest.raises(UnsupportedModel, match="off by 5.0e-01"):
        engine.check_conformance()
    assert given == [0.5]


def test_the_plain_path_reports_itself_not_exact(target_dir):
    engine = TargetEngine.load(target_dir, dtype="float32", invariant=False)
    assert not engine.numerics.exact and engine.numerics.identity.endswith("/plain")


def _skipping_bf16_kernel_check(init):
    """TargetEngine.__init__ where a bfloat16 model skips the kernels (a CPU that lacks them would raise
    from oneDNN): the test injects the hardware, not the kernels."""

    def wrapped(self, model, info, device, invariant=False, numerics=None, kernels="auto"):
        if model.dtype == torch.bfloat16:
            self.kernels, self.padding = kernels, None
            model.set_attn_implementation("draftwire_rows")
            self.invariant, self.model, self.info, self.device, self.numerics = (
                True,
                model,
                info,
                device,
                numerics,
            )
            self.passed_over, self.batched_attention, self.fused_attention = (), False, False
            self._layers = model.config.get_text_config().num_hidden_layers
            self._caches = {}
            return
        init(self, model, info, device, invariant, numerics, kernels)

    return wrapped
