"""The command line's small edges: --server without a port, min-p's flag, the pool's bind default."""

import argparse

import pytest

from draftwire_cli.flags import VERIFIER_PORT, server_address
from draftwire_cli.parser import parser


@pytest.mark.parametrize(
    "given, dialled",
    [
        ("localhost", f"localhost:{VERIFIER_PORT}"),  # gRPC alone dials 443
        ("10.0.0.2", f"10.0.0.2:{VERIFIER_PORT}"),
        ("localhost:7000", "localhost:7000"),
        ("[::1]", f"[::1]:{VERIFIER_PORT}"),
        ("::1", f"[::1]:{VERIFIER_PORT}"),
        ("[::1]:7000", "[::1]:7000"),
        ("dns:///verifier.example:7000", "dns:///verifier.example:7000"),
        ("unix:/run/draftwire.sock", "unix:/run/draftwire.sock"),
    ],
)
def test_a_server_without_a_port_is_dialled_at_serves_port(given, dialled):
    assert server_address(given) == dialled
    args = parser().parse_args(["generate", "--server", given, "--prompt", "hi"])
    assert args.server == dialled


@pytest.mark.parametrize("given", ["localhost:", "localhost:http", "localhost:70000", ":7000", "[::1]x"])
def test_a_bad_server_address_is_refused_by_name(given):
    with pytest.raises(argparse.ArgumentTypeError, match="port|host|HOST"):
        server_address(given)


def test_serve_listens_where_a_portless_server_dials():
    assert parser().parse_args(["serve", "--target", "t"]).port == VERIFIER_PORT


def test_min_p_has_its_flag():
    args = parser().parse_args(["generate", "--server", "h:1", "--prompt", "hi", "--min-p", "0.1"])
    assert args.min_p == 0.1


def test_a_draft_that_is_not_gguf_is_named_before_anything_loads(tmp_path):
    from draftwire_cli.flags import UserError
    from draftwire_cli.main import check_inputs

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    args = parser().parse_args(["generate", "--server", "h:1", "--draft", str(config), "--prompt", "hi"])
    with pytest.raises(UserError, match="not a GGUF file"):
        check_inputs(args)
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    check_inputs(parser().parse_args(["generate", "--server", "h:1", "--draft", str(gguf), "--prompt", "hi"]))


def test_demo_models_names_a_missing_directory_as_such(tmp_path):
    from draftwire_cli.models.find import find_pair

    with pytest.raises(FileNotFoundError, match="no such directory") as e:
        find_pair(tmp_path / "nonexistent")
    assert "models build" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="no model pair") as e:
        find_pair(tmp_path)  # there, but holds no pair
    assert "models build" not in str(e.value)


def test_demo_web_on_a_busy_port_fails_before_the_models_load(tmp_path):
    import socket

    from draftwire.ports import PortInUse
    from draftwire_cli.local import demo

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # A missing pair would be said (exit 2) if the port were checked after looking for the models.
        args = parser().parse_args(["demo", "--web", "--port", str(port), "--models", str(tmp_path / "none")])
        with pytest.raises(PortInUse):
            demo(args)


# The names Linux's /proc/cpuinfo prints (arch/x86/include/asm/cpufeatures.h), for the features doctor reads.
LINUX_X86_FLAGS = {
    "sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512vbmi", "avx512_vbmi2", "avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_tile",
    "amx_bf16", "amx_int8",
}  # fmt: skip


def test_doctor_reads_cpu_features_by_linuxs_names():
    from draftwire_cli.doctor import X86_FEATURES

    assert set(X86_FEATURES) <= LINUX_X86_FLAGS
