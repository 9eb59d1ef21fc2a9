"""The exact tier's kernels: DRAFTWIRE_KERNELS (auto, onednn, portable) puts every engine these tests
load on that backend, in process (here) and in the verifiers they start (the CLI's --kernels default), so
that .ci/run proves the suite on the portable backend as well as on the default one."""

import os

KERNELS = os.environ.get("DRAFTWIRE_KERNELS")

if KERNELS:
    try:
        from verifier_service.engine import TargetEngine
    except ImportError:  # the edge-only environment: no torch, no engine
        TargetEngine = None
    if TargetEngine is not None:
        _load = TargetEngine.load.__func__

        def _load_on_backend(cls, *args, kernels: str = KERNELS, **kwargs):
            return _load(cls, *args, kernels=kernels, **kwargs)

        TargetEngine.load = classmethod(_load_on_backend)
