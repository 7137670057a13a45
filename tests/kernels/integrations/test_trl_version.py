"""SAGEGRPOTrainer overrides GRPOTrainer internals written for TRL 1.16: another TRL release is refused
at import, by name, with the supported range and the install command."""

import pytest

trl = pytest.importorskip("trl")

from sage_kernels.integrations.trl import TRL_SUPPORTED, check_trl_version  # noqa: E402


@pytest.mark.parametrize("version", ["1.15.2", "1.16.0.dev0", "1.17.0", "2.0.0"])
def test_an_unsupported_trl_is_refused_naming_the_range(version):
    with pytest.raises(ImportError) as error:
        check_trl_version(version)
    assert str(error.value) == (
        f"sage_kernels.integrations.trl supports trl>=1.16,<1.17 (SAGEGRPOTrainer overrides GRPOTrainer "
        f"internals, tested on TRL 1.16), found trl {version}: pip install 'sage-rl[trl]'"
    )


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3"])
def test_the_tested_release_and_its_patches_pass(version):
    check_trl_version(version)


def test_the_installed_trl_is_supported():
    assert TRL_SUPPORTED == ("1.16", "1.17")
    check_trl_version(trl.__version__)
