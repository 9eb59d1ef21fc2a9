"""The stress kit: the wire fuzz campaign (`python -m tools.stress.fuzz`), the soak
(`python -m tools.stress.soak`) and the time to revoke a token (`python -m tools.stress.revoke`). Run
from a checkout; not in the wheel."""
