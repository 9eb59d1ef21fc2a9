"""The reference cache (tools/testkit/oracle.py): a reference is decoded once per key and read back after;
any change to the model's bytes, the numerics or the spec is a new key, and a damaged entry is decoded
again. Over the fake engine."""

from draftwire.contract import SamplingParams, SessionSpec
from tools.testkit import oracle
from tools.testkit.fakes import FakeEngine, target_continuation
from verifier_service import session  # noqa: F401  (reference_decode's: imported at collection, not timed)


def test_a_reference_is_decoded_once_per_key_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWIRE_REFERENCE_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    engine = FakeEngine()
    spec = SessionSpec((5, 6, 7), SamplingParams(), 6, ignore_eos=True)
    expected = target_continuation((5, 6, 7), 6)

    assert oracle.cached_references(target, engine, [spec]) == [expected]
    decoded = len(engine.batches)
    assert decoded > 0
    assert oracle.cached_references(target, engine, [spec]) == [expected]
    assert len(engine.batches) == decoded  # read back: no forward

    other = SessionSpec((5, 6, 7), SamplingParams(temperature=0.8, seed=3), 6, ignore_eos=True)
    oracle.cached_references(target, engine, [other])
    assert len(engine.batches) > decoded  # another spec: decoded
    decoded = len(engine.batches)

    (target / "model.safetensors").write_bytes(b"other weights")
    assert oracle.cached_references(target, engine, [spec]) == [expected]
    assert len(engine.batches) > decoded  # other bytes: decoded again
    decoded = len(engine.batches)

    for entry in (tmp_path / "cache").iterdir():  # every entry damaged
        entry.write_text("{not json")
    assert oracle.cached_references(target, engine, [spec]) == [expected]
    assert len(engine.batches) > decoded  # damaged: decoded again


def test_the_key_names_everything_the_tokens_depend_on(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    key = oracle.reference_key(target, FakeEngine(), SessionSpec((1,), SamplingParams(), 1))
    assert set(key) == {"model", "numerics", "torch", "transformers", "code", "spec"}
    assert key["numerics"] == FakeEngine().numerics.identity
