"""llama.cpp's CPU kernels, chosen at run time by the CPU the process runs on.

scripts/llama_wheel.sh builds ggml's CPU backend as one loadable module per CPU level
(`libggml-cpu-<variant>.so`: x64, sse42, sandybridge, haswell, skylakex, icelake, zen4, alderlake, …,
or armv8.0 … armv9.2) next to libllama in `llama_cpp/lib`, and links none of them in. ggml scores each
module against the CPU (cpuid, or the ARM hwcaps) and registers the best; llama-cpp-python 0.3.36 does
not ask for that (it searches next to the executable, which is python), so the installed copy does it on
import (scripts/llama_import_hook.py: any program's `llama_cpp.Llama` loads models), and `load_backends`
reports what registered, or registers it where the import did not (DRAFTWIRE_LLAMA_VARIANT, a copy
installed without the hook). `Llama` is llama_cpp.Llama after that call: every model of the project
(draft, vocabulary-only, the model kit's checks) is opened through it.

Where no CPU module fits (or none was installed), `load_backends` raises NoCpuBackend with one line that
says what to do; a model load would otherwise fail deep inside llama.cpp.

DRAFTWIRE_LLAMA_VARIANT=NAME loads that variant instead of ggml's choice (a benchmark of the variants side
by side, or a test of a lower level); one this CPU cannot run is refused, not loaded.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import llama_cpp._logger
import llama_cpp.llama_cpp

log = logging.getLogger("draftwire.llama")

LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
VARIANT_ENV = "DRAFTWIRE_LLAMA_VARIANT"
VARIANT_PREFIX = "libggml-cpu-"


class NoCpuBackend(RuntimeError):
    """No llama.cpp CPU backend registered for this CPU."""


@dataclass(frozen=True)
class Backend:
    variant: str  # the CPU module ggml chose ("haswell", "zen4", "armv8.2_2", …; "built-in" if linked in)
    features: dict[str, str]  # what that module was built with, as ggml reports it ("AVX2": "1", …)
    installed: tuple[str, ...]  # every CPU module next to libllama

    @property
    def summary(self) -> str:
        kernels = ",".join(name for name, value in self.features.items() if value == "1") or "-"
        return f"llama.cpp CPU backend {self.variant} ({kernels})"


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


_lock = threading.Lock()
_backend: Backend | None = None


def _ggml() -> ctypes.CDLL:
    """ggml's registry as libllama sees it. A wheel holds no symlinks, so libggml.so and libggml.so.0 are
    two files, and opening the first (as llama_cpp._ggml does) loads a second ggml with a registry of its
    own: symbols are looked up through libllama's handle, which resolves to the ggml it links."""
    lib = llama_cpp.llama_cpp._lib
    lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load_all_from_path.restype = None
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    return lib


def installed_variants(lib_dir: Path = LIB_DIR) -> tuple[str, ...]:
    """The CPU modules installed next to libllama, by variant name."""
    names = (p.name for p in lib_dir.glob(f"{VARIANT_PREFIX}*.so*"))
    return tuple(sorted({n[len(VARIANT_PREFIX) :].split(".so")[0] for n in names}))


def _loaded_variant() -> str:
    """The CPU module this process mapped (Linux: /proc/self/maps), or "built-in" where none is a module."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        if name.startswith(VARIANT_PREFIX):
            return name[len(VARIANT_PREFIX) :].split(".so")[0]
    return "built-in"


def _features(lib: ctypes.CDLL, reg: int) -> dict[str, str]:
    address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if not address:
        return {}
    get = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)(address)
    features, out = get(reg), {}
    i = 0
    while features[i].name:
        out[features[i].name.decode()] = features[i].value.decode()
        i += 1
    return out


def load_backends() -> Backend:
    """Registers the best CPU module for this CPU (once per process) and returns which it is; logs it.
    Raises NoCpuBackend when none registers."""
    global _backend
    with _lock:
        if _backend is not None:
            return _backend
        lib = _ggml()
        installed = installed_variants()
        if lib.ggml_backend_reg_by_name(b"CPU") is None and installed:
            quiet = llama_cpp._logger.logger.level  # ggml would print its own line per module it loads
            llama_cpp._logger.set_verbose(False)
            try:
                if os.environ.get(VARIANT_ENV):
                    _load_variant(lib, os.environ[VARIANT_ENV], installed)
                else:
                    lib.ggml_backend_load_all_from_path(str(LIB_DIR).encode())
            finally:
                llama_cpp._logger.logger.setLevel(quiet)
        reg = lib.ggml_backend_reg_by_name(b"CPU")
        if reg is None:
            found = ", ".join(installed) or "none"
            raise NoCpuBackend(
                f"llama.cpp registered no CPU backend for this CPU (modules in {LIB_DIR}: {found}); "
                "reinstall with `bash scripts/llama_wheel.sh`, which builds every CPU variant"
            )
        _backend = Backend(_loaded_variant(), _features(lib, reg), installed)
        log.info("%s", _backend.summary)
        return _backend


def _load_variant(lib: ctypes.CDLL, variant: str, installed: tuple[str, ...]) -> None:
    """Loads one named variant; raises NoCpuBackend for one not installed or that this CPU cannot run."""
    if variant not in installed:
        raise NoCpuBackend(
            f"{VARIANT_ENV}={variant}: no such llama.cpp CPU variant (installed: {', '.join(installed)})"
        )
    path = next(LIB_DIR.glob(f"{VARIANT_PREFIX}{variant}.so*"))
    score = ctypes.CDLL(str(path)).ggml_backend_score
    score.restype = ctypes.c_int
    if score() <= 0:
        raise NoCpuBackend(f"{VARIANT_ENV}={variant}: this CPU cannot run that llama.cpp variant")
    lib.ggml_backend_load(str(path).encode())


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama, opened after `load_backends`."""

    def __init__(self, *args, **kwargs):
        load_backends()
        super().__init__(*args, **kwargs)


def main() -> None:
    """`python -m edge_client.llama_runtime`: prints the chosen variant (a fresh process's choice)."""
    try:
        backend = load_backends()
    except NoCpuBackend as e:
        raise SystemExit(f"draftwire: {e}") from None
    print(backend.variant)
    print(",".join(f"{k}={v}" for k, v in backend.features.items()))
    print(os.pathsep.join(backend.installed))


if __name__ == "__main__":
    main()
