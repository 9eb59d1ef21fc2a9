"""`draftwire doctor`: what this machine can run, what is installed, and what is wrong with its fix.

- the CPU features that decide the kernels (x86: AVX2 … AVX-512, BF16, VNNI, AMX; ARM: NEON, SVE, …);
- llama.cpp: the CPU variant ggml chose for this CPU and the variants installed (the edge);
- the verifier: each dtype's exact path here, or why there is none, and a short timing of its kernels;
  which one `--dtype auto` takes;
- the devices: the GPUs torch sees (model, memory, the exact dtypes the load will try there), and which
  one `--device auto` takes;
- the model pairs installed;
- problems, each with the command that fixes it. Exit status 1 when there is one, else 0.

Works on an edge-only install (no torch): the verifier's part then says it is not installed.
"""

from __future__ import annotations

import json
import platform
import sys

# The CPU features that change which kernels run (llama.cpp's variants, oneDNN's ISA), by architecture.
X86_FEATURES = (
    "sse4_2",
    "avx",
    "f16c",
    "fma",
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512vbmi",  # Linux spells this one without the underscore (avx512_vbmi2 has it)
    "avx512_bf16",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
ARM_FEATURES = ("asimd", "asimddp", "fphp", "i8mm", "bf16", "sve", "sve2", "sme")
PROBE_SHAPES = [(576, 1536), (1536, 576)]  # SmolLM2-135M's MLP, when no target is installed


def cpu_report() -> dict:
    from verifier_service.numerics import cpu_flags, cpu_model

    flags = cpu_flags()
    wanted = ARM_FEATURES if platform.machine() in ("aarch64", "arm64") else X86_FEATURES
    model = cpu_model() or platform.processor() or platform.machine()
    return {
        "model": model,
        "machine": platform.machine(),
        "features": {f: f in flags for f in wanted},
    }


def llama_report(problems: list[str]) -> dict:
    try:
        from edge_client.llama_runtime import NoCpuBackend, installed_variants, load_backends
    except ImportError as e:
        problems.append(
            f"llama.cpp is not installed ({e}): `bash scripts/llama_wheel.sh` builds and installs it"
        )
        return {"installed": False}
    try:
        backend = load_backends()
    except NoCpuBackend as e:
        problems.append(str(e))
        return {"installed": True, "variants": list(installed_variants()), "chosen": None}
    return {
        "installed": True,
        "chosen": backend.variant,
        "features": [k for k, v in backend.features.items() if v == "1"],
        "variants": list(backend.installed),
    }


def verifier_report(probe: bool, problems: list[str]) -> dict:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {
            "installed": False,
            "note": "torch is not installed: an edge-only device (pip install '.[edge]')",
        }
    from verifier_service import numerics
    from verifier_service.invariant import NotInvariant, check_linear

    hardware = numerics.Hardware.detect("cpu")
    shapes = _probe_shapes()
    dtypes = {}
    exact = []
    for dtype in ("float32", "bfloat16"):
        try:
            numerics.plan(dtype, hardware, exact=True)
        except numerics.NoExactPath as e:
            dtypes[dtype] = {"exact": False, "why": str(e)}
            continue
        entry = {"exact": True, "kernels": hardware.kernel_class(True)}
        if probe:
            try:
                check_linear(getattr(torch, dtype), shapes)
            except NotInvariant as e:
                dtypes[dtype] = {"exact": False, "why": str(e)}
                continue
            entry["probe_ms"] = round(1000 * numerics.probe_seconds(dtype, shapes), 3)
        dtypes[dtype] = entry
        exact.append(dtype)
    if not exact:
        problems.append("no dtype is bit-exact on this CPU: serve with --no-bit-exact (output may differ)")
    auto = None
    if exact:
        auto = next(d for d in numerics.plan("auto", hardware, True) if d in exact)
    return {
        "installed": True,
        "torch": torch.__version__,
        "onednn_bf16": hardware.onednn_bf16,
        "probe_shapes": shapes,
        "dtypes": dtypes,
        "auto": auto,
    }


def gpus() -> list[dict]:
    """The CUDA GPUs torch sees: index, model, compute capability, memory (total and free, GiB)."""
    import torch

    found = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        found.append(
            {
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
                "memory_gib": round(total / 2**30, 1),
                "free_gib": round(free / 2**30, 1),
            }
        )
    return found


def device_report(found: list[dict] | None = None) -> dict:
    """The devices `--device` may name, and the exact dtypes the load tries on each GPU (the proof at
    load decides: docs/gpu.md). `found`: the GPUs (gpus(); a test injects them)."""
    try:
        import torch
    except ImportError:
        return {"installed": False}
    from verifier_service import numerics

    found = gpus() if found is None else found
    for gpu in found:
        hardware = numerics.Hardware(device="cuda", accelerator=numerics.accelerator_name(gpu["name"]))
        gpu["exact_dtypes"] = numerics.plan("auto", hardware, exact=True)
        gpu["kernels"] = hardware.kernel_class(exact=True)
    return {
        "installed": True,
        "cuda": torch.version.cuda,  # None: a CPU-only torch build
        "gpus": found,
        "auto": numerics.resolve_device("auto", len(found)),
    }


def _probe_shapes() -> list[tuple[int, int]]:
    """The installed SmolLM2 target's MLP shapes, else SmolLM2-135M's."""
    from draftwire_cli.models import smollm2

    config = smollm2.default_dir() / smollm2.TARGET / "config.json"
    try:
        data = json.loads(config.read_text())
        return [
            (data["hidden_size"], data["intermediate_size"]),
            (data["intermediate_size"], data["hidden_size"]),
        ]
    except (OSError, ValueError, KeyError):
        return PROBE_SHAPES


def models_report(problems: list[str]) -> dict:
    """The fetched pairs: SmolLM2 (the default; a problem when missing) and the optional ones of
    draftwire_cli/models/pairs.py."""
    from draftwire_cli.models import chunks, smollm2
    from draftwire_cli.models.pairs import PAIRS

    directory = smollm2.default_dir()
    fetched = smollm2.is_fetched(directory)
    if not fetched:
        problems.append(f"no SmolLM2 pair in {directory}: `draftwire models fetch smollm2` (offline, ~1 min)")
    report = {"smollm2": {"directory": str(directory), "installed": fetched}}
    for name, pair in PAIRS.items():
        directory = chunks.default_dir(pair)
        report[name] = {"directory": str(directory), "installed": chunks.is_fetched(pair, directory)}
    return report


def report(probe: bool = True, as_json: bool = False, out=sys.stdout) -> int:
    """Prints the report; returns 1 when it found a problem, else 0."""
    problems: list[str] = []
    result = {
        "cpu": cpu_report(),
        "llama_cpp": llama_report(problems),
        "verifier": verifier_report(probe, problems),
        "devices": device_report(),
        "models": models_report(problems),
        "problems": problems,
    }
    if as_json:
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        _print(result, out)
    return 1 if problems else 0


def _print(r: dict, out) -> None:
    cpu = r["cpu"]
    have = [f for f, on in cpu["features"].items() if on]
    lack = [f for f, on in cpu["features"].items() if not on]
    print(f"CPU        {cpu['model']} ({cpu['machine']})", file=out)
    print(f"  has      {' '.join(have) or '-'}", file=out)
    print(f"  lacks    {' '.join(lack) or '-'}", file=out)
    llama = r["llama_cpp"]
    if llama.get("chosen"):
        print(f"llama.cpp  CPU variant {llama['chosen']} ({','.join(llama['features'])})", file=out)
        print(f"  installed variants: {' '.join(llama['variants'])}", file=out)
    else:
        print("llama.cpp  no CPU backend (see problems)", file=out)
    verifier = r["verifier"]
    if not verifier["installed"]:
        print(f"verifier   {verifier['note']}", file=out)
    else:
        print(
            f"verifier   torch {verifier['torch']}; --dtype auto takes {verifier['auto'] or 'nothing exact'}",
            file=out,
        )
        for dtype, d in verifier["dtypes"].items():
            if d["exact"]:
                timing = f", {d['probe_ms']} ms a 5-position MLP probe" if "probe_ms" in d else ""
                print(f"  {dtype:9s} bit-exact with {d['kernels']} kernels{timing}", file=out)
            else:
                print(f"  {dtype:9s} not exact here: {d['why']}", file=out)
    _print_devices(r["devices"], out)
    for name, m in r["models"].items():
        state = (
            "installed"
            if m["installed"]
            else ("not fetched: " + m["optional"] if "optional" in m else "missing")
        )
        print(f"models     {name}: {state} ({m['directory']})", file=out)
    if r["problems"]:
        print("problems", file=out)
        for problem in r["problems"]:
            print(f"  - {problem}", file=out)
    else:
        print("problems   none", file=out)


def _print_devices(devices: dict, out) -> None:
    if devices["installed"]:
        if devices["gpus"]:
            print(f"devices    --device auto takes {devices['auto']} (CUDA {devices['cuda']})", file=out)
        else:
            why = "no GPU visible" if devices["cuda"] else "torch is built for the CPU alone"
            print(f"devices    --device auto takes cpu ({why})", file=out)
        for gpu in devices["gpus"]:
            print(
                f"  cuda:{gpu['index']}   {gpu['name']}, compute {gpu['capability']}, "
                f"{gpu['memory_gib']} GiB ({gpu['free_gib']} free); the load tries "
                f"{', '.join(gpu['exact_dtypes'])} with {gpu['kernels']} kernels, proven there",
                file=out,
            )
