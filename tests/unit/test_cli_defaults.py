"""Each default written once: the configs `draftwire serve` builds from a bare command line equal the
config dataclasses' own defaults, field by field (a flag typed with another default fails here)."""

import dataclasses

import pytest

from draftwire_cli import configs
from draftwire_cli.parser import parser
from verifier_service.admission import AdmissionConfig
from verifier_service.lifecycle import LifetimeConfig
from verifier_service.settings import SERVE_PREFIX_CACHE_BYTES, BatchConfig, PrefixCacheConfig, VerifierLimits

BARE_SERVE = ["serve", "--target", "models/demo/target"]
# Fields the command sets on purpose apart from the dataclass, and why.
APART = {
    (BatchConfig, "calibration_dir"): "serve keeps its timings in the user's cache directory",
    (PrefixCacheConfig, "budget_bytes"): "serve keeps finished caches (SERVE_PREFIX_CACHE_BYTES)",
}


def built() -> dict[type, object]:
    args = parser().parse_args(BARE_SERVE)
    admission, lifetime = configs.limits(args)
    return {
        AdmissionConfig: admission,
        LifetimeConfig: lifetime,
        BatchConfig: configs.batch(args),
        VerifierLimits: configs.verifier_limits(args),
        PrefixCacheConfig: configs.prefix_cache(args),
    }


@pytest.mark.parametrize(
    "config", [AdmissionConfig, LifetimeConfig, BatchConfig, VerifierLimits, PrefixCacheConfig]
)
def test_a_bare_serve_builds_each_config_with_its_dataclass_defaults(config):
    made, default = built()[config], config()
    differ = {
        f.name: (getattr(made, f.name), getattr(default, f.name))
        for f in dataclasses.fields(config)
        if getattr(made, f.name) != getattr(default, f.name) and (config, f.name) not in APART
    }
    assert differ == {}, f"flag default != {config.__name__} field default: {differ}"


def test_the_fields_serve_sets_apart_are_what_it_says():
    made = built()
    assert made[PrefixCacheConfig].budget_bytes == SERVE_PREFIX_CACHE_BYTES
    assert made[BatchConfig].calibration_dir.endswith("draftwire/calibration")


def test_the_test_bites_a_flag_typed_with_another_default():
    args = parser().parse_args([*BARE_SERVE, "--max-batch", "31", "--idle-timeout-s", "59"])
    assert configs.batch(args).max_batch != BatchConfig().max_batch
    assert configs.limits(args)[1].idle_timeout_s != LifetimeConfig().idle_timeout_s


def _differ(made, default, fields) -> dict:
    return {
        f: (getattr(made, f), getattr(default, f)) for f in fields if getattr(made, f) != getattr(default, f)
    }


def test_a_bare_generate_samples_and_waits_with_the_dataclasses_defaults():
    """The edge's flags too: sampling (SamplingParams) and waiting on the verifier (Timeouts). The seed
    is apart: greedy takes 0, a sampled run without one draws one."""
    from draftwire.contract import SamplingParams
    from edge_client.session import Timeouts

    args = parser().parse_args(["generate", "--server", "127.0.0.1:1", "--draft", "d.gguf", "--prompt", "x"])
    sampled = {f.name for f in dataclasses.fields(SamplingParams)} - {"seed", "logit_bias"}
    assert _differ(configs.sampling(args), SamplingParams(), sampled) == {}
    assert _differ(configs.timeouts(args), Timeouts(), ("verdict_s", "resume_s")) == {}


def test_a_bare_edge_app_builds_its_config_with_the_dataclass_defaults():
    from edge_client.config import EdgeConfig

    args = parser().parse_args(["edge", "--server", "127.0.0.1:1", "--draft", "d.gguf"])
    made = configs.edge_config(args, "127.0.0.1:1")
    assert _differ(made, EdgeConfig("127.0.0.1:1"), ("max_body", "max_waiting", "gamma", "pipeline")) == {}
