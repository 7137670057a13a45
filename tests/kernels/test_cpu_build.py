"""Building and choosing the CPU backend's operator: it builds here, a failed build falls back
with one warning, and the environment switch and the block sizing do what they say."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_kernels import cpu


def test_native_operator_builds_and_is_registered():
    ops = cpu.native_ops()
    assert ops is not None, "the csrc operator must build on this machine (gcc and ninja are installed)"
    assert hasattr(ops, "block_stats") and hasattr(ops, "block_grad")


def test_the_build_is_cached_under_a_digest_of_its_source(tmp_path):
    # torch caches one build folder per name for every checkout on the machine: with a fixed name, a
    # checkout with another csrc/ rebuilt that folder and this one then loaded the other's operator
    first, moved, edited = tmp_path / "a.cpp", tmp_path / "elsewhere.cpp", tmp_path / "b.cpp"
    first.write_text("int f() { return 1; }\n")
    moved.write_text("int f() { return 1; }\n")
    edited.write_text("int f() { return 2; }\n")
    assert cpu.extension_name(first, "AVX2") == cpu.extension_name(moved, "AVX2")
    assert cpu.extension_name(first, "AVX2") != cpu.extension_name(edited, "AVX2")
    assert cpu.extension_name(first, "AVX2") != cpu.extension_name(first, "AVX512")
    from torch.utils.cpp_extension import _get_build_directory

    assert cpu.native_ops() is not None
    name = cpu.extension_name(cpu._SOURCE, torch.backends.cpu.get_cpu_capability())
    assert (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()


def test_failed_build_warns_once_and_reports_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))  # keep the real cache untouched
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.build_extension(source, "sage_cpu_broken_for_test", []) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "chunked PyTorch path" in messages[0] and "error" in messages[0].lower()


def test_missing_source_warns_once(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.build_extension(tmp_path / "absent.cpp", "sage_cpu_absent_for_test", []) is False
    assert [str(w.message).count("not found") for w in caught] == [1]


def test_env_switch_selects_the_pytorch_blocks(monkeypatch):
    monkeypatch.setenv(cpu.NATIVE_ENV, "0")
    assert cpu._ops_for(None) is cpu._TorchBlocks
    monkeypatch.setenv(cpu.NATIVE_ENV, "1")
    assert cpu._ops_for(None) is cpu.native_ops()
    assert cpu._ops_for(False) is cpu._TorchBlocks


def test_env_switch_gives_the_same_loss_through_the_public_api(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 9, 16, generator=gen), torch.randn(300, 16, generator=gen)
    token_ids, mask = torch.randint(0, 300, (2, 9), generator=gen), torch.rand(2, 9, generator=gen) > 0.2
    args = (hidden, weight, token_ids, mask, torch.randn(2, generator=gen))
    config = LossConfig(beta=0.0)
    native = fused_linear_sage_loss(*args, config=config).loss
    monkeypatch.setenv(cpu.NATIVE_ENV, "0")
    fallback = fused_linear_sage_loss(*args, config=config).loss
    torch.testing.assert_close(native, fallback, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "total, valid, vocab, hidden, expected",
    [
        (1024, 1024, 2048, 32, 63),  # N*V/16 caps the block below N/16 rows
        (1024, 10, 2048, 32, 10),  # never more rows than there are valid ones
        (4096, 4096, 151936, 896, 224),  # a quarter of the LM head (Qwen2.5-0.5B)
        (65536, 65536, 32000, 64, 131),  # the 16 MiB floor for a thin head
        (8, 8, 100, 4, 1),  # at least one row
    ],
)
def test_block_rows(total, valid, vocab, hidden, expected):
    rows = cpu.block_rows(total, valid, vocab, hidden)
    assert rows == expected
    assert rows == 1 or rows * vocab < total * vocab // 16
    budget = max(cpu.WORKSPACE_MIN_ELEMENTS, vocab * hidden * cpu.WORKSPACE_SHARE_OF_WEIGHT)
    assert rows * vocab <= max(vocab, budget)
