# draftwire (scripts/llama_wheel.sh appends this to the installed llama_cpp/__init__.py): ggml's CPU
# kernels are loadable modules next to libllama (llama_cpp/lib/libggml-cpu-*.so), and llama-cpp-python
# 0.3.36 looks for them next to the python executable, so that no model loads until they are registered
# (upstream issue 2069). They are registered here, on import: ggml scores each module against this CPU
# and keeps the best. Quietly (ggml says a line a module); and never at the cost of the import itself.
# DRAFTWIRE_LLAMA_VARIANT=NAME leaves the choice to draftwire (edge_client/llama_runtime.py loads NAME).
#
# And llama-cpp-python's log filter reads ggml's levels by their old numbers (ggml.h now: DEBUG 1, INFO 2,
# WARN 3, ERROR 4), so that every warning passed as an error, past verbose=False (`n_ctx_seq (512) >
# n_ctx_train (0)`, `using full-size SWA cache`): its table gets ggml's numbers.
def _draftwire_load_cpu_backends() -> None:
    import ctypes
    import logging
    import os
    import pathlib

    from llama_cpp import _logger

    _logger.GGML_LOG_LEVEL_TO_LOGGING_LEVEL.update(
        {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
    )
    if os.environ.get("DRAFTWIRE_LLAMA_VARIANT"):
        return
    try:
        from llama_cpp import llama_cpp as _api

        lib = _api._lib  # libllama's own ggml (the wheel's libggml.so and .so.0 are two copies)
        lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
        if lib.ggml_backend_reg_by_name(b"CPU"):
            return
        lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_load_all_from_path.restype = None
        level = _logger.logger.level
        _logger.logger.setLevel(logging.ERROR)
        try:
            lib.ggml_backend_load_all_from_path(str(pathlib.Path(__file__).parent / "lib").encode())
        finally:
            _logger.logger.setLevel(level)
    except Exception as e:  # a model load says what is missing; the import stays usable
        logging.getLogger("llama-cpp-python").warning("draftwire: CPU backends not loaded: %s", e)


_draftwire_load_cpu_backends()
