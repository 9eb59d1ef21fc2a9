"""Which exact path the verifier runs on this hardware: `--dtype auto` and the numerics identity.

The target's logits are bit-exact against `reference` only when both run the same dtype through the same
kernels, and only with invariant kernels (verifier_service/invariant.py). Which of those this machine
has is a question for the hardware, asked at run time, never at build time:

- oneDNN's bfloat16 inner product needs avx512bw + avx512vl + avx512dq, or avx_ne_convert (its own
  error message says so); without them it raises at the first call. Its float32 one runs on any x86-64
  (and on ARM through torch's oneDNN build).
- The portable backend (`--kernels portable`, plain torch) runs wherever torch does, CUDA included;
  auto takes it where oneDNN has no kernels. The proof at load decides whether it is exact there.

`plan` (pure, the hardware passed in, so every branch is tested on every machine) turns a requested dtype
into the dtypes to try, best first, or refuses with one line that names the missing CPU feature and the
choices; auto prefers bfloat16 only where the CPU computes it natively. TargetEngine.load then proves the
first candidate at load (the kernel check of `make_invariant`, then a one-position forward against the
same positions inside a γ + 1 forward and inside a batch) and falls back to the next where the proof
fails. The outcome is a `Numerics`: dtype, kernel class, device, exact.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftwire.contract import Numerics

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = "auto, cpu, cuda or cuda:N"  # what --device takes (resolve_device)
KERNELS = ("auto", "onednn", "portable")  # verifier_service/invariant.py's backends, and auto
# oneDNN's bfloat16 path needs one of these sets of CPU features (its error: "bf16 path needs the cpu
# support avx_ne_convert or avx512bw, avx512vl and avx512dq").
BF16_FEATURES = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16"})  # "bf16": ARM's Features


class NoExactPath(ValueError):
    """No bit-exact (invariant) path for what was asked on this hardware."""


class NoSuchDevice(ValueError):
    """`--device` names a device this machine's torch does not have."""


def device_name(text: str) -> str:
    """`--device`'s syntax: auto, cpu, cuda or cuda:N, normalised (lower case, no spaces); raises
    NoSuchDevice for anything else. Whether this machine has the device is resolve_device's question."""
    name = text.strip().lower()
    kind, colon, index = name.partition(":")
    if name in ("auto", "cpu", "cuda") or (kind == "cuda" and colon and index.isdigit()):
        return name
    raise NoSuchDevice(f"unknown device {text!r}: choose {DEVICES}")


def resolve_device(requested: str | None, cuda_devices: int) -> str:
    """The torch device `--device` names on a machine whose torch sees `cuda_devices` CUDA devices
    (torch.cuda.device_count(); 0 on a CPU-only build): auto (or None) takes the first GPU where there
    is one, else the CPU. Raises NoSuchDevice, in one line, for a malformed name or a GPU that is not
    there."""
    name = device_name(requested or "auto")
    if name == "auto":
        return "cuda:0" if cuda_devices else "cpu"
    if name == "cpu":
        return "cpu"
    number = int(name.partition(":")[2] or 0)
    if number >= cuda_devices:
        seen = f"{cuda_devices} CUDA device{'s' if cuda_devices != 1 else ''}"
        raise NoSuchDevice(
            f"--device {requested}: torch sees {seen} here (a CPU-only torch, no GPU, or "
            "CUDA_VISIBLE_DEVICES hides it): choose --device cpu or auto"
        )
    return f"cuda:{number}"


@dataclass(frozen=True)
class Hardware:
    """What decides the verifier's numerics on this machine (detected, or injected by a test)."""

    device: str = "cpu"  # torch device type the target runs on
    cpu_flags: frozenset[str] = field(default_factory=frozenset)  # /proc/cpuinfo's flags (x86) or Features
    onednn: bool = True  # torch was built with oneDNN (mkldnn)
    onednn_bf16: bool = False  # oneDNN's bfloat16 kernels run on this CPU
    machine: str = "x86_64"  # platform.machine()
    accelerator: str = ""  # the GPU's model where device is one ("NVIDIA_H200"): its bits are its own

    @classmethod
    def detect(cls, device: str | None = None) -> Hardware:
        """This machine's, for `device` (a name resolve_device takes; None: auto)."""
        import torch

        dev = torch.device(resolve_device(device, torch.cuda.device_count()))
        onednn = torch.backends.mkldnn.is_available()
        accelerator = ""
        if dev.type == "cuda":
            accelerator = accelerator_name(torch.cuda.get_device_name(dev))
        return cls(
            device=str(dev.type),
            cpu_flags=cpu_flags(),
            onednn=onednn,
            onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            machine=platform.machine(),
            accelerator=accelerator,
        )

    @property
    def native_bf16(self) -> bool:
        """The CPU has bfloat16 dot-product instructions (AVX512-BF16, AMX-BF16, AVX-NE-CONVERT, ARM's
        BF16), not only oneDNN's emulation on AVX-512."""
        return bool(NATIVE_BF16 & self.cpu_flags)

    @property
    def missing_for_bf16(self) -> tuple[str, ...]:
        """The CPU features of oneDNN's bfloat16 requirements that this CPU lacks (empty: it has them)."""
        if self.onednn_bf16:
            return ()
        return tuple(f for needs in BF16_FEATURES for f in needs if f not in self.cpu_flags)

    def kernel_class(self, exact: bool, kernels: str | None = None) -> str:
        """The kernels that compute the logits, named by what changes their bits: in exact mode the
        backend (`kernels`: onednn, portable; None: the one auto takes) and, on a CPU, oneDNN's ISA (it
        and MKL dispatch by ISA, and AMX, AVX-512 and AVX2 kernels reduce differently), or the GPU's
        model; torch's own kernels otherwise."""
        where = self.accelerator or self.device
        if self.device != "cpu":
            return f"portable-{where}" if exact else f"aten-{where}"
        if not exact:
            return f"aten-{aten_level(self.cpu_flags, self.machine)}"
        return f"{kernels or 'onednn'}-{onednn_isa(self.cpu_flags, self.machine)}"

    def numerics(self, dtype: str, exact: bool, kernels: str | None = None) -> Numerics:
        return Numerics(dtype, self.kernel_class(exact, kernels), self.device, exact)


def accelerator_name(device_name: str) -> str:
    """A GPU's model as the numerics identity names it: CUDA's device name, one word ("NVIDIA_H200")."""
    return "_".join(device_name.replace("/", " ").split())


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, ARM `Features`); empty elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as Linux reports it ("" elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def onednn_isa(flags: frozenset[str], machine: str = "x86_64") -> str:
    """The most capable instruction set oneDNN dispatches to on a CPU with these flags."""
    if machine in ("aarch64", "arm64"):
        return "sve" if "sve" in flags else "asimd"
    if {"amx_tile", "amx_bf16"} <= flags:
        return "avx512_core_amx"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512_core_bf16" if "avx512_bf16" in flags else "avx512_core"
    if "avx2" in flags:
        return "avx2_vnni" if "avx_vnni" in flags else "avx2"
    return "sse41" if "sse4_1" in flags else "x64"


def aten_level(flags: frozenset[str], machine: str = "x86_64") -> str:
    """torch's own CPU dispatch level for these flags (what torch.backends.cpu.get_cpu_capability says)."""
    if machine in ("aarch64", "arm64"):
        return "sve" if "sve" in flags else "neon"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "default"


def plan(requested: str, hardware: Hardware, exact: bool, kernels: str = "auto") -> list[str]:
    """The dtypes to try for `requested` ("auto", "float32", "bfloat16") on the `kernels` backend
    ("auto", "onednn", "portable"), best first.

    Raises NoExactPath, with one line naming what is missing and the choices, where exact mode cannot
    run what was asked; ValueError for an unknown dtype or backend.
    """
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}: choose one of {', '.join(DTYPES)}")
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}: choose one of {', '.join(KERNELS)}")
    if not exact:
        if requested != "auto":
            return [requested]
        return ["bfloat16"] if hardware.device != "cpu" or hardware.onednn_bf16 else ["float32"]
    if kernels == "onednn" and (hardware.device != "cpu" or not hardware.onednn):
        where = hardware.device if hardware.device != "cpu" else "a torch build without oneDNN"
        raise NoExactPath(
            f"--kernels onednn has no kernels on {where}: use --kernels portable (or auto), or "
            "--no-bit-exact, which gives up output identical to the target alone"
        )
    if hardware.device != "cpu":
        # The portable backend; a GPU computes bfloat16 natively. The proof at load decides.
        return [requested] if requested != "auto" else ["bfloat16", "float32"]
    if not hardware.onednn:
        # portable on a CPU without oneDNN: float32 through torch's own kernels.
        if requested == "bfloat16":
            raise NoExactPath(
                "--dtype bfloat16 cannot be bit-exact with a torch built without oneDNN: "
                "choose --dtype float32 (or auto), or --no-bit-exact"
            )
        return ["float32"]
    if requested == "float32":
        return ["float32"]
    if hardware.onednn_bf16:
        if requested == "bfloat16":
            return ["bfloat16"]
        # auto: bfloat16 where the CPU computes it natively (twice float32's speed on the MLP shapes of
        # 0.1B-1.5B models, measured), float32 where oneDNN only emulates it. A rule, not a timing, so
        # that every load on one machine picks the same dtype: `serve` and `reference` agree.
        return ["bfloat16", "float32"] if hardware.native_bf16 else ["float32"]
    if requested == "bfloat16":
        raise NoExactPath(bf16_refusal(hardware))
    return ["float32"]


def bf16_refusal(hardware: Hardware) -> str:
    missing = ", ".join(hardware.missing_for_bf16) or "oneDNN's bfloat16 support"
    return (
        "--dtype bfloat16 cannot be bit-exact on this CPU: oneDNN's bfloat16 kernels need avx512bw, "
        f"avx512vl and avx512dq, or avx_ne_convert, and this CPU lacks {missing}. "
        "Choose --dtype float32 (or auto), or --no-bit-exact"
    )


def probe_seconds(dtype: str, shapes: Sequence[tuple[int, int]], rows: int = 5, repeats: int = 5) -> float:
    """The median time of `packed_linear` over `shapes` for a round of `rows` positions (γ + 1 = 5): what
    `draftwire doctor` shows of each dtype."""
    import torch

    from verifier_service.invariant import pack_weight, packed_linear

    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    weights = [
        pack_weight(torch.randn(fan_out, fan_in, generator=generator).to(torch_dtype))
        for fan_in, fan_out in shapes
    ]
    inputs = [torch.randn(rows, fan_in, generator=generator).to(torch_dtype) for fan_in, _ in shapes]
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        for x, w in zip(inputs, weights, strict=True):
            packed_linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def probe_shapes(config) -> list[tuple[int, int]]:
    """The MLP's shapes of a transformers config (the bulk of a forward's time), for `probe_seconds`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    inner = getattr(text, "intermediate_size", None) or 4 * hidden
    return [(hidden, inner), (inner, hidden)]
